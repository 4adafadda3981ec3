"""`python -m prefill_svc serve`: configuration from flags and environment (printed at start), health, reflection,
metrics, model info, a clean exit on SIGTERM; a bad configuration exits 2 naming the setting."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import httpx
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_mesh import WAIT_S, Served, free_port, run_cli

from proto.mesh.v1 import model_info_pb2
from proto.prefill.v1 import prefill_pb2_grpc


def test_serve_reports_config_health_and_metrics_and_stops_on_sigterm(serve: Callable[..., Served]) -> None:
    cache, metrics = f"127.0.0.1:{free_port()}", free_port()
    env = {"PREFILL_SVC_MAX_QUEUE": "3", "PREFILL_SVC_HANDOFF_LEASE_S": "12"}
    child = serve("prefill_svc", "--cache", cache, "--metrics-port", str(metrics), "--max-queue", "7", env=env)
    config = child.seen["config"]
    assert config["max_queue"] == 7  # the flag wins over the environment
    assert config["handoff_lease_s"] == 12.0  # from the environment
    assert config["cache"] == [cache]
    loaded = child.seen["model_loaded"]
    assert loaded["part"] == "encoder"
    assert child.health("prefill.v1.Prefill") == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(child.address) as channel:
        info = prefill_pb2_grpc.PrefillStub(channel).GetModelInfo(model_info_pb2.GetModelInfoRequest(), timeout=WAIT_S)
        assert info.fingerprint.hex() == loaded["fingerprint"]
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request])))
        assert "prefill.v1.Prefill" in {s.name for s in answer.list_services_response.service}
    assert "v41mesh_prefill_queue_depth 0.0" in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=WAIT_S).text
    assert child.terminate() == 0
    child.wait_for("stopped")


def test_a_bad_configuration_exits_2_naming_the_setting() -> None:
    zero = run_cli("prefill_svc", "serve", "--cache", "127.0.0.1:1", "--max-queue", "0")
    assert zero.returncode == 2
    assert "max_queue" in zero.stderr
    missing = run_cli("prefill_svc", "serve")
    assert missing.returncode == 2
    assert "cache" in missing.stderr
