"""cache_svc + prefill_svc + decode_svc as real gRPC servers on loopback, in this process, for the service tests.

The servers run on one background event loop (the decode engine on its own thread, as in production); tests talk to
them through plain blocking gRPC stubs. The tiny model is built once per process in float64 (equivalences are then
exact up to the quantisers, as in the model tests) and handed to every server. Shared by tests/prefill_svc and
tests/decode_svc (their conftest puts this directory on sys.path).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_svc.client import CacheClient
from cache_svc.config import CacheConfig, resolve_defaults
from cache_svc.server import CacheServer
from decode_svc.config import DecodeConfig
from decode_svc.server import DecodeServer
from decode_svc.step_times import StepTimes
from mesh.grpc_server import CHANNEL_OPTIONS
from mesh.processes import free_port as free_port  # the tests' one port picker, for ours
from model import Transformer, build_model, preset
from prefill_svc.config import PrefillConfig
from prefill_svc.server import PrefillServer
from proto.decode.v1 import decode_pb2, decode_pb2_grpc
from proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache_svc"))
from cache_helpers import FakeClock as FakeClock  # the cache tests' clock, for ours

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0  # an upper bound against hangs, never a wait: a loaded CI machine can be slow


def tiny_models() -> tuple[Transformer, Transformer]:
    """(encoder part, full model) of `tiny`, seed 0, float64."""
    args = preset("tiny")
    return build_model(args, "encoder", dtype=torch.float64), build_model(args, "full", dtype=torch.float64)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll `condition` (it reads real state over the network) until true; fail naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Loop:
    """An event loop on a background thread; `call(coro)` runs a coroutine there and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Mesh:
    """A cache (unless `cache` names addresses to use instead), a prefill and a decode replica.

    `cache_options`, `prefill` / `decode` override fields of their configurations; `clock` drives the cache's TTLs
    and leases; `times` are the step times decode's DSpark scheduler starts from."""

    def __init__(
        self,
        loop: Loop,
        data_dir: Path,
        models: tuple[Transformer, Transformer],
        *,
        clock: Callable[[], float] | None = None,
        cache: list[str] | None = None,
        cache_options: dict[str, Any] | None = None,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        times: StepTimes | None = None,
    ) -> None:
        self.loop = loop
        self.cache: CacheServer | None = None
        if cache is None:
            sizes = {"ssd_bytes": 64 << 20, "record_bytes": 64 << 20, "dram_bytes": 64 << 20, **(cache_options or {})}
            cfg = resolve_defaults(CacheConfig(port=0, data_dir=str(data_dir), **sizes))
            self.cache = CacheServer(cfg, clock=clock) if clock else CacheServer(cfg)
            loop.call(self.cache.start())
            cache = [f"127.0.0.1:{self.cache.port}"]
        self.cache_addresses = cache
        common = {"port": 0, "metrics_port": free_port(), "cache": cache, "chunk_size": 16}
        self.prefill = PrefillServer(PrefillConfig(**{**common, **(prefill or {})}), model=models[0])
        loop.call(self.prefill.start())
        common["metrics_port"] = free_port()
        self.decode = DecodeServer(DecodeConfig(**{**common, **(decode or {})}), model=models[1], times=times)
        loop.call(self.decode.start())
        self._channels = [
            grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
            for port in (self.prefill.port, self.decode.port)
        ]
        self.prefill_stub = prefill_pb2_grpc.PrefillStub(self._channels[0])
        self.decode_stub = decode_pb2_grpc.DecodeStub(self._channels[1])
        self.fingerprint = models[0].fingerprint
        self.block_tokens = models[0].args.kv_block_tokens

    # ------------------------------------------------------------------------------------------- requests
    def prefill_tokens(self, token_ids: list[int], salt: bytes, **fields: Any) -> prefill_pb2.PrefillResponse:
        request = prefill_pb2.PrefillRequest(request_id=new_id(), token_ids=token_ids, cache_salt=salt, **fields)
        return self.prefill_stub.Prefill(request, timeout=WAIT_S)

    def generate(self, **fields: Any) -> tuple[list[int], list[decode_pb2.GenerateResponse]]:
        """Run a Generate stream to its end → (every token, every message)."""
        fields.setdefault("request_id", new_id())
        messages = list(self.decode_stub.Generate(decode_pb2.GenerateRequest(**fields), timeout=WAIT_S))
        return [t for m in messages for t in m.token_ids], messages

    def load(self) -> decode_pb2.Load:
        return self.decode_stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=WAIT_S)

    def metrics(self, server: PrefillServer | DecodeServer) -> str:
        return httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=WAIT_S).text

    def cache_client(self) -> CacheClient:
        return CacheClient(self.cache_addresses)

    def stop(self) -> None:
        for channel in self._channels:
            channel.close()
        for server in (self.decode, self.prefill, self.cache):
            if server is not None:
                self.loop.call(server.stop(5))


def new_id() -> str:
    return uuid.uuid4().hex


def token_ids(ids: Iterable[int]) -> decode_pb2.TokenIds:
    return decode_pb2.TokenIds(ids=list(ids))


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent)."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---------------------------------------------------------------------------------------------------- fixtures
# Imported by the conftest of tests/prefill_svc and tests/decode_svc.
@pytest.fixture(scope="session")
def models() -> tuple[Transformer, Transformer]:
    torch.set_num_threads(1)  # tiny tensors: one thread per xdist worker beats two fighting over two cores
    return tiny_models()


@pytest.fixture(scope="session")
def loop() -> Iterator[Loop]:
    background = Loop()
    yield background
    background.close()


@pytest.fixture(scope="session")
def mesh(
    loop: Loop, models: tuple[Transformer, Transformer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    """The default mesh, shared by the tests of a process (each test isolates its prefixes with its own salt)."""
    shared = Mesh(loop, tmp_path_factory.mktemp("cache"), models)
    yield shared
    shared.stop()


@pytest.fixture
def start_mesh(loop: Loop, models: tuple[Transformer, Transformer], tmp_path: Path) -> Iterator[Callable[..., Mesh]]:
    """`start_mesh(models=(encoder, full), **Mesh options)` → a mesh of the test's own (stopped at teardown)."""
    started: list[Mesh] = []

    def start(**options: Any) -> Mesh:
        parts = options.pop("models", models)
        started.append(Mesh(loop, tmp_path / f"cache{len(started)}", parts, **options))
        return started[-1]

    yield start
    for m in started:
        m.stop()


@pytest.fixture
def salt() -> bytes:
    """A cache salt of the test's own: its prefixes never meet another test's."""
    return new_id().encode()


@pytest.fixture
def prompt() -> Callable[[int], list[int]]:
    """prompt(n) → n random token ids (SERVICE_TEST_SEED pins the seed; printed, so a failure can be replayed)."""
    seed = int(os.environ.get("SERVICE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"SERVICE_TEST_SEED={seed}")
    rng = random.Random(seed)
    return lambda n: [rng.randrange(2, 100_000) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- subprocesses
class Served:
    """`python -m <package> serve ...` in a child process (port 0: it logs the one it bound); a model service serves
    `tiny` on one thread. `serving`: wait until it serves (False: a process that serves no port of its own, such as
    a follower node of a rank group)."""

    def __init__(self, package: str, *flags: str, env: dict[str, str] | None = None, serving: bool = True) -> None:
        model = ["--model", "tiny", "--threads", "1"] if package != "cache_svc" else []
        command = [sys.executable, "-m", package, "serve", "--port", "0", *model, *flags]
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.seen: dict[str, dict[str, Any]] = {}
        self.address = f"127.0.0.1:{self.wait_for('serving', timeout_s=120)['port']}" if serving else ""

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with contextlib.suppress(json.JSONDecodeError):
                self.events.put(json.loads(line))
        self.events.put(None)

    def wait_for(self, event: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
        """The first log line of this event (every line before it is kept in `seen`)."""
        deadline = time.monotonic() + timeout_s
        while event not in self.seen:
            line = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"the process exited ({self.proc.wait()}) before logging {event!r}")
            self.seen.setdefault(line.get("event", ""), line)
        return self.seen[event]

    def health(self, service: str) -> int:
        with grpc.insecure_channel(self.address) as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=WAIT_S).status

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_cli(package: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", package, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """`serve(package, *flags, env=None, serving=True)` → a running Served child; any still running is killed at
    teardown."""
    children: list[Served] = []

    def start(package: str, *flags: str, env: dict[str, str] | None = None, serving: bool = True) -> Served:
        children.append(Served(package, *flags, env=env, serving=serving))
        return children[-1]

    yield start
    for child in children:
        child.kill()
