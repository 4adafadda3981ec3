"""Real cache servers for the tests: in-process ones on a background event loop (with an injectable
clock), and `python -m cache_svc serve` subprocesses for kill -9, SIGTERM and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import FakeClock

from cache_svc.client import CacheClient
from cache_svc.config import CacheConfig, resolve_defaults
from cache_svc.server import CacheServer

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30
RPC_TIMEOUT_S = 60  # generous deadlines: a loaded CI machine must not turn a check into DEADLINE_EXCEEDED


class InProcess:
    """A CacheServer running on its own event loop thread."""

    def __init__(self, cfg: CacheConfig, clock: FakeClock | None) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = CacheServer(cfg, clock=clock) if clock else CacheServer(cfg)
        self.running = False
        self.call(self.server.start())
        self.running = True

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def client(self, **options: Any) -> CacheClient:
        return CacheClient(self.address, **{"timeout_s": RPC_TIMEOUT_S, **options})

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        self.call(self.server.stop(5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Any]:
    """`start_server(data_dir=None, clock=None, **config)` → a running InProcess server; all stop at teardown."""
    servers: list[InProcess] = []

    def start(data_dir: Path | None = None, clock: FakeClock | None = None, **overrides: Any) -> InProcess:
        settings: dict[str, Any] = {"ssd_bytes": 256 << 20, "record_bytes": 64 << 20, "dram_bytes": 64 << 20}
        settings.update(overrides)
        cfg = resolve_defaults(
            CacheConfig(host="127.0.0.1", port=0, data_dir=str(data_dir or tmp_path / "data"), **settings)
        )
        server = InProcess(cfg, clock)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


class Subprocess:
    """`python -m cache_svc serve` in a child process; its JSON log lines are collected as they come."""

    def __init__(self, data_dir: Path, *args: str, port: int = 0, env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "cache_svc", "serve", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--data-dir", str(data_dir), "--record-bytes", str(64 << 20), *args]
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.port = 0
        serving = self.wait_for("serving")
        self.port = int(serving["port"]) if serving else 0

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                self.lines.put({"event": "text", "text": line.rstrip()})
        self.lines.put(None)

    def wait_for(self, event: str) -> dict[str, Any] | None:
        """The first log line with this event, or None if the process ended first."""
        while True:
            line = self.lines.get(timeout=START_TIMEOUT_S)
            if line is None:
                return None
            self.events.append(line)
            if line.get("event") == event:
                return line

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, **options: Any) -> CacheClient:
        return CacheClient(self.address, **{"timeout_s": RPC_TIMEOUT_S, **options})

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=START_TIMEOUT_S)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=START_TIMEOUT_S)


@pytest.fixture
def spawn() -> Iterator[Any]:
    """`spawn(data_dir, *flags, port=0, env=None)` → a running Subprocess; any still alive are killed at teardown."""
    children: list[Subprocess] = []

    def start(data_dir: Path, *args: str, port: int = 0, env: dict[str, str] | None = None) -> Subprocess:
        child = Subprocess(data_dir, *args, port=port, env=env)
        children.append(child)
        return child

    yield start
    for child in children:
        if child.proc.poll() is None:
            child.kill()
