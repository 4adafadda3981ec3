"""prefill.v1.Prefill on real servers: what lands in the cache (blocks under the shared keys, a leased handoff that
decode can restore; several records of one prefill for n choices), reuse of a cached prefix, model info, bad input, a
full queue, a cancelled prompt that never runs, an unreachable cache. How the n records are stored:
test_handoff_records."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from service_mesh import WAIT_S, Mesh, free_port, metric_value, new_id, wait_until

from mesh.block_keys import block_keys
from model import EncoderState, GlobalKVBlock, Transformer, encode_prefill
from proto.decode.v1 import decode_pb2
from proto.mesh.v1 import model_info_pb2
from proto.prefill.v1 import prefill_pb2


def test_blocks_and_the_handoff_land_in_the_cache(
    mesh: Mesh, models: tuple[Transformer, Transformer], salt: bytes, prompt: Callable
) -> None:
    encoder = models[0]
    Bt = mesh.block_tokens
    ids = prompt(2 * Bt + 5)
    answer = mesh.prefill_tokens(ids, salt)
    assert (answer.prompt_tokens, answer.cached_tokens, answer.swa_restored) == (len(ids), 0, False)
    assert answer.prefill_seconds > 0
    assert list(answer.handles) == [answer.handle]  # handoffs unset: one record, as before the field existed
    keys = block_keys(ids, block_tokens=Bt, fingerprint=encoder.fingerprint, salt=salt)
    with mesh.cache_client() as cache:
        assert cache.lookup(keys) == 2
        blocks = [GlobalKVBlock.from_bytes(b, encoder.args, encoder.fingerprint) for b in cache.get_blocks(keys)]
        handoff = prefill_pb2.Handoff.FromString(cache.get_record(answer.handle))
    assert [b.index for b in blocks] == [0, 1]
    assert list(handoff.token_ids) == ids
    assert handoff.cache_salt == salt
    state = EncoderState.from_bytes(handoff.encoder_state, encoder.args, encoder.fingerprint)
    expected = encode_prefill(encoder, ids, chunk_tokens=16)  # the encoder over the same prompt, in the test
    assert state.position == len(ids)
    assert state.to_bytes() == expected.encoder_state.to_bytes()
    assert [b.to_bytes() for b in blocks] == [b.to_bytes() for b in expected.blocks]


@pytest.mark.parametrize("handoffs", [1, 3])
def test_one_prefill_writes_a_handoff_record_per_choice(
    mesh: Mesh, salt: bytes, prompt: Callable, handoffs: int
) -> None:
    """Each record holds the same handoff under its own handle, and a real decode consumes each exactly once."""
    ids = prompt(mesh.block_tokens + 7)
    before = mesh.metrics(mesh.prefill)
    answer = mesh.prefill_tokens(ids, salt, handoffs=handoffs)
    assert len(set(answer.handles)) == handoffs
    assert answer.handle == answer.handles[0]
    encoder_runs = metric_value(mesh.metrics(mesh.prefill), "v41mesh_prefill_seconds_count") - metric_value(
        before, "v41mesh_prefill_seconds_count"
    )
    assert encoder_runs == 1  # once for them all
    with mesh.cache_client() as cache:
        payloads = [cache.get_record(handle) for handle in answer.handles]
    assert all(p == payloads[0] for p in payloads)
    assert list(prefill_pb2.Handoff.FromString(payloads[0]).token_ids) == ids
    greedy = decode_pb2.SamplingParams(temperature=0)
    replies = [
        mesh.generate(handle=handle, max_tokens=3, cache_salt=salt, sampling=greedy)[0] for handle in answer.handles
    ]
    assert all(reply == replies[0] and len(reply) == 3 for reply in replies)
    for handle in answer.handles:
        with pytest.raises(grpc.RpcError) as taken:
            mesh.generate(handle=handle, max_tokens=1, cache_salt=salt)
        assert taken.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_repeated_prefix_comes_from_the_cache(mesh: Mesh, salt: bytes, prompt: Callable) -> None:
    Bt = mesh.block_tokens
    ids = prompt(3 * Bt + 2)
    before = mesh.metrics(mesh.prefill)
    mesh.prefill_tokens(ids[: 2 * Bt + 9], salt)
    again = mesh.prefill_tokens(ids, salt)
    # Two blocks are shared; without an SWA record at their end the encoder rings are bounded-replayed.
    assert (again.cached_tokens, again.swa_restored, again.bounded_replay) == (2 * Bt, False, True)
    other_tenant = mesh.prefill_tokens(ids, salt + b"/other")
    assert other_tenant.cached_tokens == 0  # the salt separates caches
    after = mesh.metrics(mesh.prefill)

    def grew(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    assert grew("v41mesh_prefill_cache_hit_tokens_total") == 2 * Bt
    assert grew("v41mesh_prefill_prompt_tokens_total") == (2 * Bt + 9) + 2 * len(ids)
    assert grew("v41mesh_prefill_tokens_total") == (2 * Bt + 9) + (len(ids) - 2 * Bt) + len(ids)
    assert grew("v41mesh_prefill_bounded_replays_total") == 1
    assert grew("v41mesh_prefill_seconds_count") == 3
    assert "v41mesh_prefill_queue_depth 0.0" in after


def test_model_info_names_what_block_keys_need(mesh: Mesh, models: tuple[Transformer, Transformer]) -> None:
    info = mesh.prefill_stub.GetModelInfo(model_info_pb2.GetModelInfoRequest(), timeout=WAIT_S)
    args = models[0].args
    assert info.fingerprint == models[0].fingerprint == models[1].fingerprint
    assert (info.kv_block_tokens, info.vocab_size, info.sliding_window) == (16, args.vocab_size, 8)
    assert info.max_context == args.max_position_embeddings
    assert info.layout_version == 1
    assert info.model == "tiny"
    # decode describes the same model the same way (the gateway asks whichever replica answers)
    assert mesh.decode_stub.GetModelInfo(model_info_pb2.GetModelInfoRequest(), timeout=WAIT_S) == info


BAD_PROMPTS = [
    ({"token_ids": []}, "token_ids is empty"),
    ({"token_ids": [3, 200_000]}, "token_ids[1] = 200000 is outside the vocabulary"),
    ({"token_ids": [3] * 4096}, "the prompt has 4096 tokens"),
    ({"token_ids": [3], "handoff_lease_s": -1.0}, "handoff_lease_s"),
    ({"token_ids": [3], "handoff_lease_s": math.nan}, "handoff_lease_s"),
    ({"token_ids": [3], "handoff_lease_s": 1e9}, "exceeds"),
    ({"token_ids": [3], "cache_salt": b"s" * 1025}, "cache_salt has 1025 bytes"),
    ({"token_ids": [3], "handoffs": 17}, "handoffs 17 exceeds this replica's maximum 16"),
    ({"token_ids": [3], "request_id": "r" * 257}, "request_id has 257 characters"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_PROMPTS)
def test_bad_prompts_are_invalid_argument(mesh: Mesh, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(grpc.RpcError) as bad:
        mesh.prefill_stub.Prefill(prefill_pb2.PrefillRequest(**fields), timeout=WAIT_S)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in bad.value.details()


def test_a_full_queue_refuses_and_a_cancelled_prompt_never_runs(
    start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable
) -> None:
    mesh = start_mesh(prefill={"max_queue": 1, "chunk_size": 64})
    stub = mesh.prefill_stub

    def load() -> prefill_pb2.Load:
        return stub.GetLoad(prefill_pb2.GetLoadRequest(), timeout=WAIT_S)

    long = threading.Thread(target=lambda: mesh.prefill_tokens(prompt(600), salt))
    long.start()
    wait_until(lambda: load().running == 1, "the long prompt to reach the encoder")
    waiting = stub.Prefill.future(
        prefill_pb2.PrefillRequest(request_id=new_id(), token_ids=prompt(40), cache_salt=salt), timeout=WAIT_S
    )
    wait_until(lambda: load().queue_depth == 1, "the second prompt to wait")
    assert load().pending_tokens == 40
    with pytest.raises(grpc.RpcError) as refused:
        mesh.prefill_tokens(prompt(8), salt)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    waiting.cancel()
    wait_until(lambda: load().queue_depth == 0, "the cancelled prompt to leave the queue")
    long.join()
    text = mesh.metrics(mesh.prefill)
    assert metric_value(text, "v41mesh_prefill_prompt_tokens_total") == 600  # the cancelled one never ran
    assert metric_value(text, "v41mesh_prefill_requests_total", 'outcome="overloaded"') == 1


def test_an_unreachable_cache_is_failed_precondition_at_once(
    start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable
) -> None:
    mesh = start_mesh(cache=[f"127.0.0.1:{free_port()}"], prefill={"cache_retry_s": 60.0, "cache_timeout_s": 1.0})
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as down:
            mesh.prefill_tokens(prompt(20), salt)
        assert down.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "token ids" in down.value.details()
    text = mesh.metrics(mesh.prefill)
    assert metric_value(text, "v41mesh_prefill_requests_total", 'outcome="cache_unavailable"') == 2
    assert metric_value(text, "v41mesh_prefill_prompt_tokens_total") == 20  # the second never ran the encoder
    assert metric_value(text, "v41mesh_prefill_cache_errors_total", 'op="put_handoff"') == 1
