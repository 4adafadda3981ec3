"""The harness of the end-to-end tests: the tiny model's mesh, reading gateway metrics and replica logs, waiting for a
condition, killing and restarting mesh processes, extra gateway processes over the same replicas."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh.processes import Mesh, MeshSpec, free_port, http_ready
from proto.decode.v1 import decode_pb2, decode_pb2_grpc
from proto.mesh.v1 import model_info_pb2
from proto.prefill.v1 import prefill_pb2_grpc

MODEL = "DeepSeek-V4.1-Flash"
START_TIMEOUT_S = 300.0
WAIT_TIMEOUT_S = 30.0
# Short deadlines, so a frozen replica is noticed within a test's time.
GATEWAY_ARGS = ["--stall-timeout-s", "20", "--load-interval-s", "0.25", "--inhibit-s", "2"]
# Records live an hour: a record that expires during a test is one the test made expire.
CACHE_ARGS = ["--ssd-bytes", str(256 << 20), "--dram-bytes", str(64 << 20), "--record-bytes", str(64 << 20),
              "--record-ttl-s", "3600"]  # fmt: skip


def tiny_mesh(data_dir: Path, replicas: int, ranks: int = 1) -> MeshSpec:
    """The `tiny` model's mesh: a cache, `replicas` prefill and decode replicas, each a group of `ranks` rank
    processes (`mesh up --prefill-ranks --decode-ranks`), and a gateway."""
    return MeshSpec(
        model="tiny",
        data_dir=data_dir,
        prefill_replicas=replicas,
        decode_replicas=replicas,
        prefill_ranks=ranks,
        decode_ranks=ranks,
        cache_args=CACHE_ARGS,
        gateway_args=GATEWAY_ARGS,
    )


def serve(spec: MeshSpec) -> Iterator[Mesh]:
    """A fixture's body: the mesh started and healthy; after the tests, SIGTERM stops every process with status 0."""
    running = Mesh(spec)
    running.start(START_TIMEOUT_S)
    yield running
    codes = running.stop()
    assert codes == {child.name: 0 for child in running.children}, codes


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of a gateway metric's samples that carry `labels` (0 when there are none yet)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def prefills_of(mesh: Mesh, request_id: str) -> list[dict]:
    """The prompts the mesh's prefill replicas encoded for a request: their `prefill` log lines (one per prompt) that
    carry its id. (Log lines, not metrics: a counter does not say which request it counted.)"""
    lines = []
    for child in mesh.children:
        if child.name.startswith("prefill"):
            lines += [json.loads(line) for line in child.log.read_text().splitlines() if '"event": "prefill"' in line]
    return [line for line in lines if line.get("request_id") == request_id]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_TIMEOUT_S) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def decode_load(address: str) -> decode_pb2.Load:
    with grpc.insecure_channel(address) as channel:
        return decode_pb2_grpc.DecodeStub(channel).GetLoad(decode_pb2.GetLoadRequest(), timeout=5)


def model_info(address: str) -> model_info_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return prefill_pb2_grpc.PrefillStub(channel).GetModelInfo(model_info_pb2.GetModelInfoRequest(), timeout=5)


def signal_child(mesh: Mesh, name: str, sig: signal.Signals) -> None:
    os.kill(mesh.child(name).pid, sig)  # type: ignore[arg-type]


@contextmanager
def killed(mesh: Mesh, *names: str) -> Iterator[None]:
    """The named children are SIGKILLed by the test inside; afterwards they are restarted and healthy again, and
    the gateway sees them."""
    try:
        yield
    finally:
        for name in names:
            child = mesh.child(name)
            if child.running():
                child.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                child.process.wait()  # type: ignore[union-attr]
        mesh.restart(*names, timeout_s=START_TIMEOUT_S)
        wait_for(mesh.child("gateway").healthy, "the gateway to see every replica up again")


def mesh_up(data_dir: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """`python -m mesh up` on a free port with small cache tiers under `data_dir` (and `flags`), as a user runs it;
    returns the process and the base URL it prints once every process is healthy."""
    root = Path(__file__).resolve().parents[2]
    up = subprocess.Popen(
        [sys.executable, "-m", "mesh", "up", "--port", "0", "--data-dir", str(data_dir),
         "--cache-args", f"--ssd-bytes {64 << 20} --record-bytes {16 << 20} --dram-bytes {16 << 20}", *flags],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert up.stdout is not None
    base_url = up.stdout.readline().strip()  # printed once every process is healthy
    assert base_url.startswith("http://127.0.0.1:"), up.stderr.read() if up.stderr else ""
    return up, base_url


def start_gateway(
    mesh: Mesh, log: Path, *flags: str, prefill: str | None = None
) -> tuple[str, subprocess.Popen[bytes]]:
    """Another gateway process over the mesh's replicas (or the given prefill addresses), with `flags`; returns its
    base URL once it is ready."""
    port = free_port()
    if prefill is None:
        prefill = ",".join(c.address for c in mesh.children if c.name.startswith("prefill"))
    decode = ",".join(c.address for c in mesh.children if c.name.startswith("decode"))
    argv = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--grpc-port", "0",
            "--prefill", prefill, "--decode", decode, "--cache", mesh.child("cache").address, *flags]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_ready(url), f"the gateway on port {port} (log: {log})", START_TIMEOUT_S)
    return url, process
