"""Generate through real servers: prefill → cache → decode equals decode's own prefill; batching changes nothing;
stop tokens, budgets, logprobs and seeds behave; a finished turn is written back, before its stream closes, so the next
turn is an exact hit."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from service_mesh import WAIT_S, Mesh, Served, metric_value, new_id, token_ids

from mesh.block_keys import block_keys, sequence_key
from proto.decode.v1 import decode_pb2

LENGTH = decode_pb2.FINISH_REASON_LENGTH
STOP = decode_pb2.FINISH_REASON_STOP


def test_prefill_handoff_decode_equals_a_local_prefill(mesh: Mesh, salt: bytes, prompt: Callable) -> None:
    ids = prompt(37)
    handoff = mesh.prefill_tokens(ids, salt)
    assert handoff.prompt_tokens == 37
    assert handoff.cached_tokens == 0
    assert not handoff.swa_restored
    through_cache, messages = mesh.generate(handle=handoff.handle, max_tokens=4, cache_salt=salt)
    local, local_messages = mesh.generate(token_ids=token_ids(ids), max_tokens=4, cache_salt=salt + b"/cold")
    assert through_cache == local
    assert len(through_cache) == 4
    final = messages[-1]
    assert final.finish_reason == LENGTH
    assert local_messages[-1].finish_reason == LENGTH
    assert final.usage.prompt_tokens == 37
    assert final.usage.completion_tokens == 4
    assert all(m.finish_reason == decode_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])


def test_speculative_greedy_equals_plain_greedy(start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable):
    mesh = start_mesh(decode={"draft_policy": "full"})  # every step drafts γ and verifies them (all rejected)
    ids = prompt(29)
    plain, _ = mesh.generate(token_ids=token_ids(ids), max_tokens=5, disable_speculation=True, cache_salt=salt + b"1")
    spec, messages = mesh.generate(token_ids=token_ids(ids), max_tokens=5, cache_salt=salt + b"2")
    assert spec == plain
    assert messages[-1].usage.draft_tokens_proposed >= 4  # four steps after the first token, each verified drafts


def test_sequences_of_different_lengths_batched_equal_each_alone(mesh: Mesh, salt: bytes, prompt: Callable) -> None:
    requests: list[dict[str, Any]] = [
        {"token_ids": token_ids(prompt(n)), "max_tokens": k, "cache_salt": salt + bytes([i]), "disable_speculation": d}
        for i, (n, k, d) in enumerate([(5, 4, False), (23, 2, False), (40, 3, True)])
    ]
    alone = [mesh.generate(**r)[0] for r in requests]
    before = metric_value(mesh.metrics(mesh.decode), "v41mesh_decode_batch_size_sum", 'lane="speculative"')
    steps = metric_value(mesh.metrics(mesh.decode), "v41mesh_decode_batch_size_count", 'lane="speculative"')
    # A companion sequence streams until cancelled, so each request below joins a running batch however slowly the
    # threads start (a loaded machine once ran three short requests one after another).
    companion = mesh.decode_stub.Generate(
        decode_pb2.GenerateRequest(
            request_id=new_id(), token_ids=token_ids(prompt(9)), max_tokens=3000, cache_salt=salt + b"/companion"
        ),
        timeout=WAIT_S,
    )
    assert next(companion).token_ids  # it is running
    together: list[list[int]] = [[] for _ in requests]

    def run(i: int) -> None:
        together[i] = mesh.generate(**{**requests[i], "cache_salt": requests[i]["cache_salt"] + b"/batched"})[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    companion.cancel()
    assert together == alone
    text = mesh.metrics(mesh.decode)
    rows = metric_value(text, "v41mesh_decode_batch_size_sum", 'lane="speculative"') - before
    new_steps = metric_value(text, "v41mesh_decode_batch_size_count", 'lane="speculative"') - steps
    assert rows > new_steps  # some step ran several sequences at once


def test_stop_token_budget_and_logprobs(mesh: Mesh, salt: bytes, prompt: Callable) -> None:
    ids = prompt(21)
    full, messages = mesh.generate(
        token_ids=token_ids(ids), max_tokens=5, cache_salt=salt, logprobs=True, top_logprobs=3
    )
    logprobs = [lp for m in messages for lp in m.logprobs]
    assert len(logprobs) == len(full) == 5
    for token, lp in zip(full, logprobs, strict=True):
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert len(lp.top) == 3
        assert lp.top[0].token_id == token
        assert abs(lp.top[0].logprob - lp.logprob) < 1e-6
        assert lp.logprob < 0
    stop = full[2]
    stopped, messages = mesh.generate(
        token_ids=token_ids(ids), max_tokens=5, cache_salt=salt + b"/stop", stop_token_ids=[stop, 1]
    )
    assert stopped == full[: full.index(stop) + 1]  # the stop token is the last one sent
    assert messages[-1].finish_reason == STOP
    assert messages[-1].usage.completion_tokens == len(stopped)
    assert not any(m.logprobs for m in messages)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(mesh: Mesh, salt: bytes, prompt: Callable) -> None:
    ids = prompt(17)
    sampling = decode_pb2.SamplingParams(temperature=1.0, top_k=50, seed=1234)

    def sample(seed: int, tag: bytes) -> list[int]:
        s = decode_pb2.SamplingParams()
        s.CopyFrom(sampling)
        s.seed = seed
        return mesh.generate(token_ids=token_ids(ids), max_tokens=4, sampling=s, cache_salt=salt + tag)[0]

    first = sample(1234, b"a")
    noise = threading.Thread(target=lambda: sample(99, b"noise"))
    noise.start()
    again = sample(1234, b"b")
    noise.join()
    assert again == first
    assert sample(4321, b"c") != first


def test_a_finished_turn_makes_the_next_an_exact_prefix_hit(mesh: Mesh, salt: bytes, prompt: Callable) -> None:
    Bt = mesh.block_tokens
    ids = prompt(2 * Bt + 5)
    turn1 = mesh.prefill_tokens(ids, salt)
    reply, _ = mesh.generate(handle=turn1.handle, max_tokens=4, cache_salt=salt)
    # The record covers the prompt and every reply token but the last (sampled, never run through the model).
    covered = ids + reply[:-1]
    record = sequence_key(covered, block_tokens=Bt, fingerprint=mesh.fingerprint, salt=salt)
    with mesh.cache_client() as cache:  # the stream closed once they were written: the next turn cannot miss them
        assert cache.has_record(record)
        keys = block_keys(covered, block_tokens=Bt, fingerprint=mesh.fingerprint, salt=salt)
        assert cache.lookup(keys) == len(keys)
    turn2 = ids + reply + prompt(Bt)
    warm = mesh.prefill_tokens(turn2, salt)
    assert warm.swa_restored
    assert not warm.bounded_replay
    assert warm.cached_tokens == len(covered) // Bt * Bt >= len(ids) // Bt * Bt  # whole blocks
    warm_reply, messages = mesh.generate(handle=warm.handle, max_tokens=4, cache_salt=salt)
    assert messages[-1].usage.cached_tokens == warm.cached_tokens
    cold_reply, cold = mesh.generate(token_ids=token_ids(turn2), max_tokens=4, cache_salt=salt + b"/cold")
    assert cold[-1].usage.cached_tokens == 0
    assert warm_reply == cold_reply


def test_a_finished_stream_closes_once_its_write_back_is_in_the_cache(
    serve: Callable[..., Served], start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable, tmp_path: Path
) -> None:
    """The final message goes out at once; the stream closes only once the sequence's blocks and SWA record are in the
    cache, so a caller that waits for the close (the gateway, before the conversation's next turn) cannot miss them.
    The cache is a real process, stopped (SIGSTOP) while the sequence finishes: the stream stays open until it runs
    again."""
    cache = serve("cache_svc", "--data-dir", str(tmp_path))
    mesh = start_mesh(cache=[cache.address], decode={"cache_timeout_s": WAIT_S})
    ids = prompt(12)
    request = decode_pb2.GenerateRequest(request_id=new_id(), token_ids=token_ids(ids), max_tokens=40, cache_salt=salt)
    stream = mesh.decode_stub.Generate(request, timeout=WAIT_S)
    tokens = list(next(stream).token_ids)  # the prompt is restored: decode is done reading the cache
    cache.proc.send_signal(signal.SIGSTOP)
    try:
        for message in stream:
            tokens += message.token_ids
            if message.finish_reason:
                break
        assert len(tokens) == 40
        with pytest.raises(grpc.FutureTimeoutError):  # still open: its write-back waits for the cache
            stream.exception(timeout=0.5)
    finally:
        cache.proc.send_signal(signal.SIGCONT)
    assert next(stream, None) is None  # closed once the cache took the writes
    covered = ids + tokens[:-1]
    Bt, fp = mesh.block_tokens, mesh.fingerprint
    with mesh.cache_client() as client:
        assert client.has_record(sequence_key(covered, block_tokens=Bt, fingerprint=fp, salt=salt))
        keys = block_keys(covered, block_tokens=Bt, fingerprint=fp, salt=salt)
        assert client.lookup(keys) == len(keys) == 3
