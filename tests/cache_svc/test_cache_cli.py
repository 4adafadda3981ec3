"""`python -m cache_svc serve`: configuration from flags and env, start-up errors, health, reflection, metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
from cache_helpers import key_of
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mesh.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cache_svc", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )


def test_config_from_env_and_flags_is_printed_at_start(spawn: Any, tmp_path: Path) -> None:
    env = {"CACHE_SVC_DRAM_BYTES": "12345", "CACHE_SVC_RETENTION_HOURS": "96", "CACHE_SVC_RECORD_TTL_S": "60"}
    server = spawn(tmp_path / "data", "--record-ttl-s", "30", env=env)
    config = next(e for e in server.events if e.get("event") == "config")
    assert config["dram_bytes"] == 12345  # env
    assert config["retention_hours"] == 96.0  # env
    assert config["record_ttl_s"] == 30.0  # the flag wins over the env
    assert config["data_dir"] == str(tmp_path / "data")
    assert config["ssd_bytes"] > 0  # 0 = automatic, resolved before printing
    with server.client() as client:
        assert client.put_record(b"r", b"x", ttl_s=3600) == 30


def test_bad_configuration_exits_2_naming_the_setting(tmp_path: Path) -> None:
    bad_size = _run("serve", "--data-dir", str(tmp_path), "--ssd-bytes", "lots")
    assert bad_size.returncode == 2
    assert "--ssd-bytes" in bad_size.stderr
    negative = _run("serve", "--data-dir", str(tmp_path), "--dram-bytes", "-1")
    assert negative.returncode == 2
    assert "dram_bytes" in negative.stderr
    missing = _run("serve")
    assert missing.returncode == 2
    assert "data_dir" in missing.stderr
    level = _run("serve", "--data-dir", str(tmp_path), "--log-level", "loud")
    assert level.returncode == 2
    assert "log_level" in level.stderr
    assert _run().returncode == 2


def test_a_data_directory_serves_one_process(spawn: Any, tmp_path: Path) -> None:
    spawn(tmp_path / "data")
    second = _run("serve", "--port", "0", "--data-dir", str(tmp_path / "data"))
    assert second.returncode == 1
    assert "in use by another cache_svc" in second.stderr


def test_health_reflection_and_metrics(spawn: Any, tmp_path: Path) -> None:
    metrics_port = free_port()
    server = spawn(tmp_path / "data", "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1")
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "cache.v1.KvCache"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in answer.list_services_response.service}
        assert {"cache.v1.KvCache", "grpc.health.v1.Health"} <= names

    with server.client() as client:
        client.put_blocks([(key_of(1), b"x" * 1000)])
        client.get_blocks([key_of(1), key_of(2)])
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    assert 'cache_hits_total{tier="dram"} 1.0' in text
    assert 'cache_misses_total{tier="ssd"} 1.0' in text
    assert 'cache_entries{tier="ssd"} 1.0' in text
    assert 'cache_refusals_total{reason="ssd_full"} 0.0' in text
    assert 'cache_rpc_duration_seconds_count{method="PutBlocks"} 1.0' in text
    assert "cache_commit_group_blocks_bucket" in text
