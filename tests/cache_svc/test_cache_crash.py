"""Crash safety and graceful stop of a real `python -m cache_svc serve` process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from cache_helpers import key_of, payload_of

from cache_svc.client import CacheClient, CacheError
from proto.cache.v1 import cache_pb2 as pb
from proto.cache.v1 import cache_pb2_grpc

SIZES = (56_960, 4096, 300_000, 700)  # a full-size block, tiny ones, a large one
WRITERS = 4
BATCH = 4


def _block(n: int) -> tuple[bytes, bytes]:
    key = key_of(n)
    return key, payload_of(key, SIZES[n % len(SIZES)])


class Load:
    """Writer threads putting batches until the server stops answering; remembers what was acknowledged."""

    def __init__(self, address: str, target: int) -> None:
        self.acked: list[bytes] = []
        self.sent: dict[bytes, bytes] = {}
        self.reached = threading.Event()
        self._target = target
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(address, w)) for w in range(WRITERS)]
        for t in self._threads:
            t.start()

    def _run(self, address: str, worker: int) -> None:
        n = worker * 1_000_000
        with CacheClient(address, timeout_s=60) as client:
            while True:
                batch = [_block(n + i) for i in range(BATCH)]
                n += BATCH
                with self._lock:
                    self.sent.update(batch)
                try:
                    committed = client.put_blocks(batch)
                except CacheError:
                    return
                with self._lock:
                    self.acked += committed
                    if len(self.acked) >= self._target:
                        self.reached.set()

    def join(self) -> None:
        for t in self._threads:
            t.join(timeout=30)


def _hold_uncommitted_put(address: str, key: bytes) -> Callable[[], None]:
    """Open a put that stages `key` and never commits; returns the function that lets it go."""
    release = threading.Event()

    def messages() -> Iterator[pb.PutBlocksRequest]:
        yield pb.PutBlocksRequest(slices=[pb.PutSlice(key=key, total_bytes=3, offset=0, data=b"abc")])
        release.wait(30)

    channel = grpc.insecure_channel(address)
    call = cache_pb2_grpc.KvCacheStub(channel).PutBlocks.future(messages(), timeout=30)

    def let_go() -> None:
        release.set()
        call.cancel()
        channel.close()

    return let_go


def _wait_staged(client: CacheClient) -> None:
    deadline = time.monotonic() + 10
    while next(iter(client.stats().values()))["staged_bytes"] == 0:
        assert time.monotonic() < deadline, "the open put never reached the server"


def _check_recovered(address: str, load: Load, uncommitted: bytes) -> None:
    with CacheClient(address, timeout_s=60) as client:
        assert client.get_blocks(load.acked) == [load.sent[k] for k in load.acked]
        in_flight = [k for k in load.sent if k not in set(load.acked)]
        for key, payload in zip(in_flight, client.get_blocks(in_flight), strict=True):
            assert payload is None or payload == load.sent[key]  # committed or absent, never torn
        assert client.lookup([uncommitted]) == 0


def test_kill_9_mid_stream_loses_no_acknowledged_block(spawn: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = spawn(data, "--segment-bytes", str(2 << 20))  # small segments: seals happen during the run
    uncommitted = key_of(-1 & 0xFFFF_FFFF)
    let_go = _hold_uncommitted_put(server.address, uncommitted)
    try:
        with server.client() as client:
            _wait_staged(client)
        load = Load(server.address, target=400)
        assert load.reached.wait(60)
        server.kill()  # SIGKILL while the writers are mid-stream
        load.join()
    finally:
        let_go()

    restarted = spawn(data, "--segment-bytes", str(2 << 20))
    recovered = next(e for e in restarted.events if e.get("event") == "recovered")
    assert recovered["blocks"] >= len(load.acked)
    _check_recovered(restarted.address, load, uncommitted)


def test_sigterm_finishes_in_flight_commits_and_exits_0(spawn: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = spawn(data, "--grace-s", "10")
    uncommitted = key_of(-2 & 0xFFFF_FFFF)
    let_go = _hold_uncommitted_put(server.address, uncommitted)
    with server.client() as client:
        _wait_staged(client)
    load = Load(server.address, target=200)
    assert load.reached.wait(60)
    let_go()  # the held put's client goes away without commit
    assert server.terminate() == 0
    load.join()
    assert server.wait_for("stopped") is not None

    restarted = spawn(data)
    recovered = next(e for e in restarted.events if e.get("event") == "recovered")
    assert recovered["truncated_bytes"] == 0  # a graceful stop leaves no torn tail
    _check_recovered(restarted.address, load, uncommitted)
