"""`python -m decode_svc serve`: configuration from flags and environment, health, metrics, and SIGTERM: a running
stream is drained to its end before the process exits 0."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import httpx
from grpc_health.v1 import health_pb2
from service_mesh import WAIT_S, Served, free_port, token_ids

from proto.decode.v1 import decode_pb2, decode_pb2_grpc


def test_sigterm_drains_a_running_stream_then_exits_0(serve: Callable[..., Served], prompt: Callable) -> None:
    metrics = free_port()
    env = {"DECODE_SVC_MAX_BATCH": "3", "DECODE_SVC_SPECULATION": "false"}
    child = serve("decode_svc", "--metrics-port", str(metrics), "--max-draft", "2", env=env)
    config = child.seen["config"]
    assert (config["max_batch"], config["speculation"], config["max_draft"]) == (3, False, 2)
    assert config["cache"] == []  # no cache: token ids only, no reuse, no write-back
    assert child.health("decode.v1.Decode") == health_pb2.HealthCheckResponse.SERVING
    assert "v41mesh_decode_queue_depth 0.0" in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=WAIT_S).text
    with grpc.insecure_channel(child.address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        request = decode_pb2.GenerateRequest(token_ids=token_ids(prompt(12)), max_tokens=8)
        stream = stub.Generate(request, timeout=WAIT_S)
        first = next(stream)
        child.proc.send_signal(15)  # SIGTERM while the generation runs
        rest = list(stream)
    tokens = [t for m in [first, *rest] for t in m.token_ids]
    assert rest[-1].finish_reason == decode_pb2.FINISH_REASON_LENGTH
    assert len(tokens) == 8
    assert child.proc.wait(timeout=WAIT_S) == 0
    child.wait_for("stopped")
