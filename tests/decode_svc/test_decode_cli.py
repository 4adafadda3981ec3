"""`python -m decode_svc serve`: configuration from flags and environment, health (SERVING once the engine's start-up
is done), metrics, and SIGTERM: a running stream is drained to its end before the process exits 0."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from service_mesh import WAIT_S, Loop, Served, free_port, token_ids

from decode_svc.config import DecodeConfig
from decode_svc.server import DecodeServer
from decode_svc.step_times import Forward
from mesh.grpc_server import StartError
from model import DecodeBatch, Transformer
from proto.decode.v1 import decode_pb2, decode_pb2_grpc


def test_sigterm_drains_a_running_stream_then_exits_0(serve: Callable[..., Served], prompt: Callable) -> None:
    metrics = free_port()
    env = {"DECODE_SVC_MAX_BATCH": "3", "DECODE_SVC_SPECULATION": "false", "DECODE_SVC_MASK_THREADS": "2"}
    child = serve("decode_svc", "--metrics-port", str(metrics), "--max-draft", "2", env=env)
    config = child.seen["config"]
    assert (config["max_batch"], config["speculation"], config["max_draft"], config["mask_threads"]) == (3, False, 2, 2)
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


def test_a_replica_serves_once_its_engine_has_warmed(loop: Loop, models: tuple[Transformer, Transformer]) -> None:
    """Health turns SERVING (the gRPC server starts) only after the engine's start-up: its graphs (on a GPU) and the
    profile that seeds DSpark's step times, which a router's first request must not wait behind."""
    cfg = DecodeConfig(port=0, metrics_port=0, draft_policy="measured", log_level="warning")
    server = DecodeServer(cfg, model=models[1])
    loop.call(server.start())
    try:
        assert server.engine is not None
        assert server.engine.warmed.is_set()
        assert server.engine.times.measured(*Forward)  # profiled before the first request could arrive
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            request = decode_pb2.GenerateRequest(token_ids=token_ids([5, 6, 7]), max_tokens=2)
            assert sum(len(m.token_ids) for m in stub.Generate(request, timeout=WAIT_S)) == 2
    finally:
        loop.call(server.stop(1))


def test_a_replica_whose_step_graphs_cannot_be_captured_does_not_start(
    loop: Loop, models: tuple[Transformer, Transformer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture that fails (on a GPU: a bug, after which torch's CUDA generator stays in capture mode and no request
    could be sampled) fails the start with the lane and the error named — `serve` logs cannot_start and exits 1 —
    instead of a replica that turns SERVING and fails every request."""

    def refused(batch: DecodeBatch, widths: object, progress: object = None) -> None:
        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")

    monkeypatch.setattr(DecodeBatch, "capture", refused)
    server = DecodeServer(DecodeConfig(port=0, metrics_port=0, log_level="warning"), model=models[1])
    try:
        with pytest.raises(StartError, match="lane's step graphs could not be captured: it->second->use_count"):
            loop.call(server.start())
        assert server.port == 0  # no gRPC server was started
    finally:
        loop.call(server.stop(1))
