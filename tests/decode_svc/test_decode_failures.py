"""What goes wrong around decode: Abort and a vanished client free the slot at once, a full queue refuses, a lost or
expired handoff is NOT_FOUND, malformed requests are INVALID_ARGUMENT naming the field, an unreachable cache still
serves token ids (the failed write-back is counted)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from service_mesh import WAIT_S, FakeClock, Mesh, free_port, metric_value, new_id, token_ids, wait_until

from proto.decode.v1 import decode_pb2

LONG = 3000  # max_tokens of a generation that runs until it is stopped


def _first_message(mesh: Mesh, **fields: Any) -> tuple[Any, decode_pb2.GenerateResponse]:
    call = mesh.decode_stub.Generate(decode_pb2.GenerateRequest(**fields), timeout=WAIT_S)
    return call, next(call)


def test_abort_ends_the_stream_and_frees_the_slot(start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable):
    mesh = start_mesh(decode={"max_batch": 1, "max_queue": 1})
    running = {"request_id": new_id(), "token_ids": token_ids(prompt(9)), "max_tokens": LONG, "cache_salt": salt}
    call, first = _first_message(mesh, **running)
    assert first.token_ids
    # The only slot is taken: one more may wait, the next is refused.
    waiting = mesh.decode_stub.Generate(
        decode_pb2.GenerateRequest(token_ids=token_ids(prompt(4)), max_tokens=2, cache_salt=salt), timeout=WAIT_S
    )
    wait_until(lambda: mesh.load().queue_depth == 1, "the second request to wait")
    with pytest.raises(grpc.RpcError) as refused:
        mesh.generate(token_ids=token_ids(prompt(4)), max_tokens=2, cache_salt=salt)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting" in refused.value.details()

    aborted = mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id=running["request_id"]), timeout=WAIT_S)
    assert aborted.found
    rest = list(call)
    assert rest[-1].finish_reason == decode_pb2.FINISH_REASON_ABORT
    assert rest[-1].usage.completion_tokens < LONG
    # The waiting request gets the slot and runs to its end.
    assert list(waiting)[-1].finish_reason == decode_pb2.FINISH_REASON_LENGTH
    assert mesh.load().running == 0
    assert not mesh.decode_stub.Abort(decode_pb2.AbortRequest(request_id="nobody"), timeout=WAIT_S).found
    assert 'reason="abort_rpc"' in mesh.metrics(mesh.decode)


def test_a_client_that_goes_away_frees_its_slot(start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable):
    mesh = start_mesh(decode={"max_batch": 1})
    call, _ = _first_message(mesh, token_ids=token_ids(prompt(7)), max_tokens=LONG, cache_salt=salt)
    assert mesh.load().running == 1
    call.cancel()
    wait_until(lambda: mesh.load().running == 0, "the cancelled sequence to leave the batch")
    assert metric_value(mesh.metrics(mesh.decode), "v41mesh_decode_aborts_total", 'reason="client_gone"') == 1
    tokens, _ = mesh.generate(token_ids=token_ids(prompt(5)), max_tokens=2, cache_salt=salt)
    assert len(tokens) == 2


def test_a_missing_or_taken_handoff_is_not_found(mesh: Mesh, salt: bytes, prompt: Callable) -> None:
    for handle in (b"handoff:" + bytes(16), b"x"):
        with pytest.raises(grpc.RpcError) as missing:
            mesh.generate(handle=handle, max_tokens=2)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert "token_ids" in missing.value.details()  # it says what to do instead
    handoff = mesh.prefill_tokens(prompt(6), salt)
    mesh.generate(handle=handoff.handle, max_tokens=1)
    with pytest.raises(grpc.RpcError) as taken:
        mesh.generate(handle=handoff.handle, max_tokens=1)
    assert taken.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_unclaimed_handoff_expires_with_its_lease(start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable):
    clock = FakeClock()
    mesh = start_mesh(clock=clock)
    handoff = mesh.prefill_tokens(prompt(6), salt, handoff_lease_s=2.0)
    with mesh.cache_client() as cache:
        assert cache.has_record(handoff.handle)
        clock.advance(2.5)
        assert not cache.has_record(handoff.handle)
    with pytest.raises(grpc.RpcError) as expired:
        mesh.generate(handle=handoff.handle, max_tokens=1)
    assert expired.value.code() == grpc.StatusCode.NOT_FOUND


Constraint = decode_pb2.OutputConstraint
BAD_REQUESTS = [
    ({"max_tokens": 2}, "either handle"),
    ({"token_ids": token_ids([])}, "token_ids is empty"),
    ({"token_ids": token_ids([5, 129_280])}, "token_ids[1] = 129280 is outside the vocabulary"),
    ({"token_ids": token_ids([5] * 4096)}, "4096 tokens"),
    ({"token_ids": token_ids([5]), "max_tokens": 4096}, "max_tokens 4096 does not fit"),
    ({"handle": b"h" * 65}, "handle must be 1 to 64 bytes"),
    ({"token_ids": token_ids([5]), "stop_token_ids": [1, 10**6]}, "stop_token_ids[1]"),
    ({"token_ids": token_ids([5]), "top_logprobs": 21}, "top_logprobs"),
    ({"token_ids": token_ids([5]), "sampling": decode_pb2.SamplingParams(temperature=-1)}, "temperature"),
    ({"token_ids": token_ids([5]), "sampling": decode_pb2.SamplingParams(temperature=float("nan"))}, "temperature"),
    ({"token_ids": token_ids([5]), "sampling": decode_pb2.SamplingParams(top_p=1.5)}, "top_p"),
    ({"token_ids": token_ids([5]), "cache_salt": b"s" * 2000}, "cache_salt"),
    ({"token_ids": token_ids([5]), "request_id": "r" * 300}, "request_id"),
    ({"token_ids": token_ids([5]), "constraint": Constraint(regex="(unclosed")}, "constraint.regex: Regex parsing"),
    ({"token_ids": token_ids([5]), "constraint": Constraint(json_schema="{no")}, "constraint.json_schema: not JSON"),
    ({"token_ids": token_ids([5]), "constraint": Constraint(json_schema='{"type": "wrong"}')}, 'type "wrong"'),
    ({"token_ids": token_ids([5]), "constraint": Constraint(structural_tag='{"type": 1}')}, "structural_tag"),
    ({"token_ids": token_ids([5]), "constraint": Constraint(banned_token_ids=[7, 129_280])}, "banned_token_ids[1]"),
    ({"token_ids": token_ids([5]), "constraint": Constraint(json_object=True, answer_prefix="no")}, "answer_prefix"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_REQUESTS)
def test_malformed_requests_are_invalid_argument(mesh: Mesh, fields: dict[str, Any], message: str) -> None:
    load = mesh.load()
    with pytest.raises(grpc.RpcError) as bad:
        mesh.generate(**fields)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in bad.value.details()
    after = mesh.load()
    assert (after.queue_depth, after.running) == (load.queue_depth, load.running)  # nothing was admitted


def test_an_unreachable_cache_still_serves_token_ids(start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable):
    mesh = start_mesh(cache=[f"127.0.0.1:{free_port()}"], decode={"cache_timeout_s": 1.0})
    tokens, messages = mesh.generate(token_ids=token_ids(prompt(20)), max_tokens=3, cache_salt=salt)
    assert len(tokens) == 3
    assert messages[-1].usage.cached_tokens == 0
    wait_until(
        lambda: metric_value(mesh.metrics(mesh.decode), "v41mesh_decode_writebacks_total", 'outcome="failed"') >= 1,
        "the failed write-back to be counted",
    )
    with pytest.raises(grpc.RpcError) as lost:  # a handle cannot be read from it
        mesh.generate(handle=b"handoff:" + bytes(16), max_tokens=1)
    assert lost.value.code() == grpc.StatusCode.NOT_FOUND
