"""Decode's own prefill of a token-ids prompt, a chunk per engine iteration.

- Exact: the chunks give the blocks and encoder state of one `encode_with_past` over the whole prompt, byte for byte
  (from scratch, from an SWA record that ends inside a block, from blocks alone by bounded replay); through real
  servers, a small --chunk-size decodes the same greedy tokens and writes back the same blocks and record as one
  larger than the prompt.
- Interleaved: an engine driven one iteration at a time (`Engine.iterate`, its thread never started) steps a running
  sequence once per chunk of a long prompt, so the stream gets a token per chunk where it used to wait for the whole
  prompt.
- Freed: an abort or a shutdown while prefilling frees the slot; a chunk that fails fails its sequence only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from driven import Driven, driven_engine
from service_mesh import Mesh, metric_value, token_ids

from decode_svc.local_prefill import LocalPrefill
from decode_svc.sequence import End, Failure, State
from mesh.block_keys import block_keys, sequence_key
from model import DecodeBatch, EncoderState, Past, Transformer, encode_prefill
from model_service.kvstore import encode_with_past
from proto.decode.v1 import decode_pb2

CHUNK = 16


# ------------------------------------------------------------------------------------------------ exactness
def chunked(model: Transformer, ids: list[int], past: Past | None, chunk: int) -> LocalPrefill:
    prefill = LocalPrefill(model, ids, past, chunk)
    while not prefill.advance():
        pass
    return prefill


def first_logits(model: Transformer, past: Past | None, blocks: list, state: EncoderState) -> torch.Tensor:
    cached = past.blocks if past is not None else []
    return DecodeBatch(model).join(cached + blocks, state)[1]


@pytest.mark.parametrize("past_kind", ["none", "record", "blocks"])
def test_chunks_equal_one_encode_over_the_whole_prompt(models, prompt: Callable, past_kind: str) -> None:
    model = models[1]
    Bt, chunk = model.args.kv_block_tokens, 12  # chunk boundaries fall inside blocks too
    ids = prompt(5 * Bt + 7)
    turn1 = encode_prefill(model, ids[: 2 * Bt + 5], chunk_tokens=chunk)  # a previous turn that ended mid-block
    past = {
        "none": None,
        "record": Past(turn1.blocks, turn1.encoder_state),
        "blocks": Past(turn1.blocks),
    }[past_kind]
    one = encode_with_past(model, ids, past, chunk)
    prefill = chunked(model, ids, past, chunk)
    start = {"none": 0, "record": 2 * Bt + 5, "blocks": 2 * Bt}[past_kind]
    assert prefill.chunks == -(-(len(ids) - start) // chunk)
    out = prefill.output
    assert out is not None
    assert [b.to_bytes() for b in out.blocks] == [b.to_bytes() for b in one.blocks]
    assert out.encoder_state.to_bytes() == one.encoder_state.to_bytes()
    assert (out.cached_tokens, out.bounded_replay) == (one.cached_tokens, one.bounded_replay)
    assert out.bounded_replay == (past_kind == "blocks")
    logits = first_logits(model, past, out.blocks, out.encoder_state)
    assert torch.equal(logits, first_logits(model, past, one.blocks, one.encoder_state))


def test_a_small_chunk_size_serves_and_writes_back_what_one_chunk_does(
    mesh: Mesh, start_mesh: Callable[..., Mesh], models, salt: bytes, prompt: Callable
) -> None:
    """Real servers: the shared mesh prefills in chunks of 16, the other in one chunk (as decode did before)."""
    whole = start_mesh(decode={"chunk_size": 4096, "speculation": False})
    ids = prompt(5 * CHUNK + 3)
    before = metric_value(mesh.metrics(mesh.decode), "v41mesh_decode_local_prefill_chunks_total")
    request = {"token_ids": token_ids(ids), "max_tokens": 5, "cache_salt": salt, "disable_speculation": True}
    small, _ = mesh.generate(**request)
    after = metric_value(mesh.metrics(mesh.decode), "v41mesh_decode_local_prefill_chunks_total")
    assert after - before == 6  # ⌈83 / 16⌉
    large, _ = whole.generate(**request)
    assert metric_value(whole.metrics(whole.decode), "v41mesh_decode_local_prefill_chunks_total") == 1
    assert small == large
    covered = ids + small[:-1]
    keys = block_keys(covered, block_tokens=mesh.block_tokens, fingerprint=mesh.fingerprint, salt=salt)
    record = sequence_key(covered, block_tokens=mesh.block_tokens, fingerprint=mesh.fingerprint, salt=salt)
    stored = []
    for m in (mesh, whole):
        with m.cache_client() as cache:
            stored.append((cache.get_blocks(keys), cache.get_record(record)))
    (small_blocks, small_record), (large_blocks, large_record) = stored
    assert None not in small_blocks
    assert small_blocks == large_blocks
    assert small_record is not None
    assert large_record is not None
    # Float parts of the record (H^{L/2}) follow the chunking's reduction order; the rest is the same bytes.
    a, b = (EncoderState.from_bytes(r, models[1].args, mesh.fingerprint) for r in (small_record, large_record))
    assert (a.position, a.ring_start) == (b.position, b.ring_start)
    for x, y in [(a.ring_data, b.ring_data), (a.ring_scale, b.ring_scale), (a.history, b.history)]:
        assert torch.equal(x, y)
    for layer, entries in a.tail.items():
        assert all(torch.equal(x, y) for x, y in zip(entries.tensors(), b.tail[layer].tensors(), strict=True))
    for x, y in [(a.hidden, b.hidden), (a.hidden_pre, b.hidden_pre)]:
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    for layer, (kv, score) in a.pending.items():
        torch.testing.assert_close(kv, b.pending[layer][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(score, b.pending[layer][1], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------- the engine, driven
@pytest.fixture
def driven(models) -> Iterator[Driven]:
    with driven_engine(models[1], chunk_size=CHUNK) as engine:
        yield engine


def greedy_alone(model: Transformer, ids: list[int], n: int) -> list[int]:
    out = encode_prefill(model, ids, chunk_tokens=len(ids))
    batch = DecodeBatch(model)
    _, logits = batch.join(out.blocks, out.encoder_state)
    tokens = [int(logits.argmax())]
    while len(tokens) < n:
        tokens.append(int(batch.decode_step(tokens[-1:])[0].argmax()))
    return tokens


def test_a_running_stream_gets_a_token_per_chunk_of_a_long_local_prefill(driven: Driven, prompt: Callable) -> None:
    engine = driven.engine
    running = driven.submit(prompt(5), limit=100)
    engine.iterate()  # one chunk prefills it, it joins (its first token) and steps (its second)
    assert running.state is State.RUNNING
    assert len(running.output) == 2
    chunks = 5
    ids = prompt(chunks * CHUNK - 3)
    long = driven.submit(ids, limit=4)
    before = len(running.output)
    # An iteration runs one chunk, then steps the lanes: the running stream gets a token after each of the first
    # chunks - 1, and the long prompt's first token comes with its last chunk, before that iteration's step.
    for i in range(1, chunks):
        engine.iterate()
        assert long.state is State.PREFILLING
        assert long.output == []
        assert len(running.output) == before + i
        assert (engine.running, engine.waiting) == (2, 0)  # a prefilling sequence holds its batch slot
        assert driven.metric("running") == 2
    engine.iterate()
    assert long.state is State.RUNNING
    assert len(long.output) == 2  # its first token, then the iteration's step
    assert len(running.output) == before + chunks
    assert driven.metric("local_prefill_chunks_total") == 1 + chunks
    assert driven.metric("local_prefills_total", {"reason": "token_ids"}) == 2
    driven.run_to_end(long)
    assert long.output == greedy_alone(engine.model, ids, 4)
    # What a prefill replica would have written: the prompt's complete blocks, once, when its prefill was done.
    seq, covered, blocks, state = driven.written[1]
    assert (seq, covered, state) == (long, ids, None)
    assert [b.index for b in blocks] == list(range(len(ids) // engine.model.args.kv_block_tokens))


def test_an_abort_while_prefilling_frees_the_slot_and_the_engine_goes_on(driven: Driven, prompt: Callable) -> None:
    engine = driven.engine
    long = driven.submit(prompt(4 * CHUNK), limit=4)
    engine.iterate()
    engine.iterate()
    assert long.state is State.PREFILLING
    assert engine.running == 1
    assert engine.abort(long.request_id, "abort_rpc")
    engine.iterate()
    assert long.state is State.ABORTED
    assert (engine.running, engine.waiting) == (0, 0)
    assert not engine.prefilling
    assert (driven.metric("running"), driven.metric("queue_depth")) == (0, 0)
    assert driven.metric("aborts_total", {"reason": "abort_rpc"}) == 1
    assert driven.metric("local_prefill_chunks_total") == 2  # no chunk ran after the abort
    assert driven.metric("local_prefills_total", {"reason": "token_ids"}) == 0
    assert driven.written == []  # nothing half-done is written back
    (end,) = driven.received(long)
    assert isinstance(end, End)
    assert end.reason == decode_pb2.FINISH_REASON_ABORT
    after = driven.submit(prompt(7), limit=3)
    driven.run_to_end(after)
    assert len(after.output) == 3
    assert after.state is State.FINISHED


def test_a_chunk_that_fails_fails_its_sequence_only(driven: Driven, models, prompt: Callable) -> None:
    engine = driven.engine
    running = driven.submit(prompt(5), limit=100)
    engine.iterate()
    Bt = engine.model.args.kv_block_tokens
    ids = prompt(3 * Bt)
    unfit = encode_prefill(models[1], ids[: 2 * Bt]).blocks[1:]  # a prefix that does not start at block 0
    broken = driven.submit(ids, limit=4, past=Past(unfit))
    engine.iterate()
    assert broken.state is State.FAILED
    (failure,) = driven.received(broken)
    assert isinstance(failure, Failure)
    assert "decode could not prefill the prompt" in failure.message
    assert "blocks 0.." in failure.message
    assert (engine.running, engine.waiting) == (1, 0)
    steps = len(running.output)
    engine.iterate()
    assert len(running.output) == steps + 1


def test_a_shutdown_while_prefilling_aborts_it(driven: Driven, prompt: Callable) -> None:
    engine = driven.engine
    long = driven.submit(prompt(8 * CHUNK), limit=1000)  # it cannot finish before the thread sees the stop
    engine.iterate()
    assert long.state is State.PREFILLING
    engine.start()  # the thread takes over, and is told to stop at once
    engine.stop()
    assert long.state is State.ABORTED
    assert (engine.running, engine.waiting) == (0, 0)
    assert driven.metric("aborts_total", {"reason": "shutdown"}) == 1
