"""cache_svc against Redis, side by side in one run (issue 5's performance section).

    python bench/cache_bench.py [--quick] [--sections throughput,restart,trace] [--out bench/out/cache_bench.json]

- throughput: put and get of 56,960 B payloads (one 64-token block of the released model; also in batches
  of 16, a 1,024-token prefill) and 1 MiB payloads, at 1, 8 and 32 concurrent clients, GB/s and p50/p99
  latency. Peers: Redis as LMCache would use it (in memory, no persistence) and Redis with the durability
  we give (AOF, fsync on every write). Ours fsyncs every commit (group commit) and reads from its DRAM tier.
  Our client library keeps freed payload memory for reuse (cache_svc.heap); for gets a third peer, `redis+heap`,
  is the in-memory Redis read by client processes with that same malloc setting, so that the comparison shows
  what comes from the store and transport rather than from glibc's defaults.
- restart: 1 M blocks on disk, time from process start to serving, and the p99 of a 64-key lookup with
  1 M blocks indexed; Redis reloading the same 1 M keys from its RDB, and 64 EXISTS in one pipeline.
- trace: replay of the Mooncake conversation trace (512-token blocks → 8 of our blocks each) through a
  real server on the trace's own clock; prefix hit rate against capacity, for 72 h retention (full →
  refuse) and for 10 min retention (expired blocks make room), with the unbounded hit rate beside the
  Mooncake paper's ≈ 40 %; plot in docs/cache_trace_hit_rate.png.

Redis comes from the machine (Debian: `apt-get install -y redis-server`); without it the Redis columns are
skipped with a message. Everything runs on loopback; the JSON goes to bench/out/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cache_svc.client import CacheClient  # noqa: E402
from cache_svc.heap import keep_freed_memory  # noqa: E402
from cache_svc.segment_log import SegmentLog  # noqa: E402
from mesh.processes import free_port  # noqa: E402

BLOCK = 56_960  # 64 tokens × 890 B
MIB = 1 << 20
TRACE = ROOT.parent / "shared/data/traces/mooncake_conversation.jsonl"
MOONCAKE_PAPER_HIT_RATE = 0.40
console = Console(width=150)


# --- servers ------------------------------------------------------------------------------------------


class Ours:
    """`python -m cache_svc serve` on a fresh or given data directory."""

    name = "ours"

    def __init__(self, data_dir: Path, *flags: str) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "cache_svc", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--data-dir", str(data_dir), *flags]
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log = data_dir.parent / f"{data_dir.name}.log"
        self.started = time.perf_counter()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, cwd=ROOT, stderr=log)
        self.address = f"127.0.0.1:{self.port}"
        self.ready_s = _wait(lambda: _grpc_ready(self.address), self.proc) - self.started

    def event(self, name: str) -> dict[str, Any]:
        """The server's first log line with this event."""
        lines = (json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{"))
        return next(line for line in lines if line.get("event") == name)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


class Redis:
    """`redis-server` on loopback; `durable` turns on the AOF with an fsync per write."""

    def __init__(self, work_dir: Path, *, durable: bool) -> None:
        self.name = "redis-aof" if durable else "redis"
        self.port = free_port()
        work_dir.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(work_dir),
        ]
        command += ["--protected-mode", "no", "--logfile", "", *persistence]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.address = f"127.0.0.1:{self.port}"
        self.ready_s = _wait(self._ping, self.proc) - self.started

    def _ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port).ping())
        except redis.exceptions.ConnectionError:
            return False

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def _grpc_ready(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            return False
    return True


def _wait(ready: Callable[[], bool], proc: subprocess.Popen[Any], timeout_s: float = 120) -> float:
    """Poll until ready; returns the perf_counter time at which it was."""
    deadline = time.perf_counter() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if time.perf_counter() > deadline:
            raise TimeoutError("server did not become ready")
        time.sleep(0.01)
    return time.perf_counter()


# --- throughput: client processes ---------------------------------------------------------------------


@dataclass
class Cell:
    system: str
    op: str  # put | get
    size: int
    batch: int
    clients: int
    ops: int = 0
    gb_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    errors: int = 0
    load_1m: float = 0.0  # the machine's 1-minute load average when the cell started


def _payload(size: int, seed: int) -> bytes:
    return (hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=64).digest() * (size // 64 + 1))[:size]


def _key(prefix: str, n: int) -> bytes:
    return hashlib.blake2b(f"{prefix}/{n}".encode(), digest_size=16).digest()


PUT_DB = 1  # Redis database of the put cells (flushed after each)
HEAP_SUFFIX = "+heap"  # a Redis peer whose client processes use our malloc setting (cache_svc.heap)


def _redis(address: str, db: int = 0) -> Any:
    import redis

    host, port = address.split(":")
    return redis.Redis(host=host, port=int(port), db=db, socket_timeout=600)


def _client_ops(system: str, address: str, op: str, size: int, batch: int, keys: list[bytes]) -> Iterator[Any]:
    """A generator of zero-argument callables, each one operation of `batch` payloads."""
    payload = _payload(size, 1)
    if system.endswith(HEAP_SUFFIX):
        keep_freed_memory()
    if system == "ours":
        client = CacheClient(address, timeout_s=60)
        if op == "put":
            return (lambda ks=ks: client.put_blocks([(k, payload) for k in ks]) for ks in keys)  # type: ignore[misc]
        return (lambda ks=ks: client.get_blocks(ks) for ks in keys)  # type: ignore[misc]
    r = _redis(address, PUT_DB if op == "put" else 0)
    if op == "put":
        if batch == 1:
            return (lambda ks=ks: r.set(ks[0], payload) for ks in keys)  # type: ignore[misc]
        return (lambda ks=ks: r.mset(dict.fromkeys(ks, payload)) for ks in keys)  # type: ignore[misc]
    if batch == 1:
        return (lambda ks=ks: r.get(ks[0]) for ks in keys)  # type: ignore[misc]
    return (lambda ks=ks: r.mget(ks) for ks in keys)  # type: ignore[misc]


def _worker(spec: dict[str, Any], ready: Any, go: Any, window: Any, out: Any) -> None:
    """One client process: `threads` clients, connected before the clock starts, timing each operation."""
    results: list[tuple[float, float]] = []
    errors = 0
    lock = threading.Lock()
    prepared = threading.Barrier(spec["threads"] + 1)

    def client(thread: int) -> None:
        nonlocal errors
        if spec["op"] == "put":
            prefix = f"{spec['tag']}/{spec['worker']}/{thread}"
            keys = ([_key(prefix, n * spec["batch"] + i) for i in range(spec["batch"])] for n in range(10**9))
        else:
            rng = np.random.default_rng(spec["worker"] * 1000 + thread)
            pool = spec["keys"]
            keys = ([pool[i] for i in rng.integers(0, len(pool), spec["batch"])] for _ in range(10**9))
        ops = _client_ops(spec["system"], spec["address"], spec["op"], spec["size"], spec["batch"], keys)
        prepared.wait()
        go.wait()
        start_at, stop_at = window[0], window[1]
        mine: list[tuple[float, float]] = []
        for operation in ops:
            wall = time.time()
            if wall >= stop_at:
                break
            began = time.perf_counter()
            try:
                operation()
            except Exception:
                with lock:
                    errors += 1
                continue
            if wall >= start_at:
                mine.append((wall, time.perf_counter() - began))
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(spec["threads"])]
    for t in threads:
        t.start()
    prepared.wait()
    ready.put(spec["worker"])
    for t in threads:
        t.join()
    out.put((results, errors))


def measure(
    system: str, address: str, op: str, size: int, batch: int, clients: int, seconds: float, keys: list[bytes], tag: str
) -> Cell:
    """Run `clients` concurrent clients spread over up to 4 processes; time `seconds` after a 20 % warm-up."""
    load = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    processes = min(clients, 4)
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    window = ctx.Array("d", 2)
    procs = []
    for w in range(processes):
        spec = {
            "system": system,
            "address": address,
            "op": op,
            "size": size,
            "batch": batch,
            "worker": w,
            "threads": clients // processes + (w < clients % processes),
            "keys": keys,
            "tag": tag,
        }
        p = ctx.Process(target=_worker, args=(spec, ready, go, window, out))
        p.start()
        procs.append(p)
    for _ in procs:
        ready.get(timeout=120)
    now = time.time()
    window[0], window[1] = now + 0.2 * seconds, now + 1.2 * seconds  # warm up, then measure `seconds`
    go.set()
    samples: list[tuple[float, float]] = []
    errors = 0
    for _ in procs:
        got, errs = out.get(timeout=seconds + 300)
        samples += got
        errors += errs
    for p in procs:
        p.join()
    kept = np.array([lat for _, lat in samples])
    cell = Cell(system, op, size, batch, clients, errors=errors, load_1m=load)
    if kept.size:
        cell.ops = int(kept.size)
        cell.gb_s = kept.size * batch * size / seconds / 1e9
        cell.p50_ms = float(np.percentile(kept, 50) * 1e3)
        cell.p99_ms = float(np.percentile(kept, 99) * 1e3)
    return cell


def _preload(system: str, address: str, size: int, count: int) -> list[bytes]:
    keys = [_key(f"get/{size}", n) for n in range(count)]
    payload = _payload(size, 1)
    if system == "ours":
        with CacheClient(address, timeout_s=120) as client:
            for i in range(0, count, 16):
                client.put_blocks([(k, payload) for k in keys[i : i + 16]])
    else:
        r = _redis(address)
        for k in keys:
            r.set(k, payload)
    return keys


THROUGHPUT_SHAPES = [(BLOCK, 1), (BLOCK, 16), (MIB, 1)]


def throughput(work: Path, seconds: float, clients: list[int], with_redis: bool) -> list[Cell]:
    """Every cell runs ours and the peers back to back, so load drift on the machine hits all of them."""
    cells: list[Cell] = []
    total = len(THROUGHPUT_SHAPES) * len(clients) * (4 + 3 if with_redis else 2)
    with tqdm(total=total, desc="throughput", unit="cell", disable=None) as progress:
        for size, batch in THROUGHPUT_SHAPES:
            run_dir = Path(tempfile.mkdtemp(dir=work))
            servers: list[Any] = [Ours(run_dir / "ours", "--ssd-bytes", str(40 << 30), "--dram-bytes", str(2 << 30))]
            if with_redis:
                servers += [Redis(run_dir / "redis", durable=False), Redis(run_dir / "redis-aof", durable=True)]
            keys = {s.name: _preload(s.name, s.address, size, 256 if size < MIB else 64) for s in servers}
            for n in clients:
                for op in ("put", "get"):
                    for server in servers:
                        systems = [server.name]
                        if op == "get" and server.name == "redis":
                            systems.append(server.name + HEAP_SUFFIX)
                        for system in systems:
                            tag = f"{op}/{size}/{batch}/{n}"
                            cells.append(
                                measure(system, server.address, op, size, batch, n, seconds, keys[server.name], tag)
                            )
                            progress.update()
                        if op == "put" and server.name != "ours":
                            _redis(server.address, PUT_DB).flushdb()  # keep Redis memory to what gets need
            for server in servers:
                server.stop()
            shutil.rmtree(run_dir, ignore_errors=True)
    return cells


def _throughput_table(cells: list[Cell]) -> Table:
    table = Table(title="put / get: GB/s and latency (ratio = ours ÷ peer GB/s)")
    columns = ("op", "payload", "batch", "clients", "system", "GB/s", "p50 ms", "p99 ms", "ours ÷ this", "load")
    for column in columns:
        table.add_column(column, justify="right")
    ours = {(c.op, c.size, c.batch, c.clients): c for c in cells if c.system == "ours"}
    for c in cells:
        mine = ours.get((c.op, c.size, c.batch, c.clients))
        ratio = f"{mine.gb_s / c.gb_s:.2f}×" if mine and c.gb_s and c.system != "ours" else ""
        size = "1 MiB" if c.size == MIB else f"{c.size / 1000:.2f} kB"
        table.add_row(
            c.op,
            size,
            str(c.batch),
            str(c.clients),
            c.system,
            f"{c.gb_s:.3f}",
            f"{c.p50_ms:.2f}",
            f"{c.p99_ms:.2f}",
            ratio,
            f"{c.load_1m:.1f}",
        )
    return table


# --- restart and lookup with 1 M blocks ---------------------------------------------------------------


def _fill_data_dir(data_dir: Path, blocks: int, payload_bytes: int) -> list[bytes]:
    """Write `blocks` committed blocks straight through the segment log (the writer thread's code path)."""
    log, _ = SegmentLog.open(data_dir, 256 * MIB)
    payload = _payload(payload_bytes, 7)
    keys = [_key("restart", n) for n in range(blocks)]
    now = time.time()
    for i in tqdm(range(0, blocks, 4096), desc="writing 1 M blocks", unit="group", disable=None):
        log.append([([(k, payload) for k in keys[i : i + 4096]], now)])
        log.roll_if_full()
    log.close()
    return keys


def _lookup_latencies(call: Callable[[list[bytes]], Any], keys: list[bytes], rounds: int) -> dict[str, float]:
    rng = np.random.default_rng(3)
    samples = []
    for _ in range(rounds):
        start = int(rng.integers(0, len(keys) - 64))
        batch = keys[start : start + 64]
        began = time.perf_counter()
        call(batch)
        samples.append(time.perf_counter() - began)
    arr = np.array(samples) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99))}


def restart(work: Path, blocks: int, payload_bytes: int, with_redis: bool) -> dict[str, Any]:
    data = work / "restart-ours"
    keys = _fill_data_dir(data, blocks, payload_bytes)
    disk = sum(p.stat().st_size for p in data.iterdir())
    server = Ours(data, "--ssd-bytes", str(disk * 2))
    out: dict[str, Any] = {"blocks": blocks, "payload_bytes": payload_bytes, "disk_bytes": disk}
    with CacheClient(server.address) as client:
        assert client.lookup(keys[-64:]) == 64, "restart lost blocks"
        recovery_s = server.event("recovered")["seconds"]
        out["ours"] = {
            "restart_s": server.ready_s,
            "recovery_s": recovery_s,
            **_lookup_latencies(client.lookup, keys, 3000),
        }
    server.stop()
    shutil.rmtree(data, ignore_errors=True)
    if with_redis:
        import redis

        peer = Redis(work / "restart-redis", durable=False)
        r = redis.Redis(port=peer.port, socket_timeout=600)  # SAVE of 1 GB takes a while on a busy machine
        payload = _payload(payload_bytes, 7)
        for i in tqdm(range(0, blocks, 4096), desc="loading redis", unit="batch", disable=None):
            r.mset(dict.fromkeys(keys[i : i + 4096], payload))
        r.save()
        peer.stop()
        peer = Redis(work / "restart-redis", durable=False)  # reloads dump.rdb
        r = redis.Redis(port=peer.port)
        while r.info("persistence")["loading"]:
            time.sleep(0.01)
        assert r.dbsize() == blocks
        ready = time.perf_counter() - peer.started

        def exists(batch: list[bytes]) -> list[int]:
            pipe = r.pipeline(transaction=False)
            for k in batch:
                pipe.exists(k)
            return pipe.execute()

        out["redis"] = {"restart_s": ready, **_lookup_latencies(exists, keys, 3000)}
        peer.stop()
        shutil.rmtree(work / "restart-redis", ignore_errors=True)
    return out


# --- Mooncake trace replay ----------------------------------------------------------------------------


@dataclass
class Replay:
    policy: str
    capacity_blocks: int | None  # None = unbounded
    hit_rate: float = 0.0
    refused_puts: int = 0
    evictions: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _trace() -> list[dict[str, Any]]:
    with open(TRACE) as f:
        return [json.loads(line) for line in f]


def _our_keys(request: dict[str, Any]) -> list[bytes]:
    """8 of our 64-token blocks per 512-token trace block; only full 64-token blocks of the input count."""
    n = request["input_length"] // 64
    ids = request["hash_ids"]
    return [hashlib.blake2b(f"{ids[i // 8]}/{i % 8}".encode(), digest_size=16).digest() for i in range(n)]


REPLAY_PAYLOAD = 64  # bytes per block: capacity is counted in blocks, the hit rate does not depend on size


def replay(trace: list[dict[str, Any]], work: Path, policy: str, capacity_blocks: int | None) -> Replay:
    """Every request: look up its prefix, then put the blocks it missed, on the trace's clock."""
    import asyncio

    from cache_svc.client import CacheError
    from cache_svc.config import CacheConfig, resolve_defaults
    from cache_svc.server import CacheServer
    from mesh.logging import configure_logging

    configure_logging("cache_svc", level="error")  # refusals are expected here by the thousand

    entry = REPLAY_PAYLOAD + 36
    clock_now = [trace[0]["timestamp"] / 1000]
    retention_h = 72.0 if policy == "retain-72h" else 10 / 60
    ssd = (capacity_blocks * entry * 17 // 16) if capacity_blocks else 64 << 30
    data = Path(tempfile.mkdtemp(dir=work))
    cfg = resolve_defaults(
        CacheConfig(
            host="127.0.0.1",
            port=0,
            data_dir=str(data),
            ssd_bytes=ssd,
            retention_hours=retention_h,
            dram_bytes=0,
            record_bytes=MIB,
            log_level="error",
        )
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = CacheServer(cfg, clock=lambda: clock_now[0])
    asyncio.run_coroutine_threadsafe(server.start(), loop).result()
    result = Replay(policy, capacity_blocks)
    hits = total = 0
    payload = bytes(REPLAY_PAYLOAD)
    began = time.perf_counter()
    with CacheClient(f"127.0.0.1:{server.port}", timeout_s=60) as client:
        for request in tqdm(
            trace, desc=f"{policy} {capacity_blocks or 'unbounded'}", unit="req", leave=False, disable=None
        ):
            clock_now[0] = request["timestamp"] / 1000
            keys = _our_keys(request)
            hit = client.lookup(keys)
            hits += hit
            total += len(keys)
            if hit < len(keys):
                try:
                    client.put_blocks([(k, payload) for k in keys[hit:]])
                except CacheError:
                    result.refused_puts += 1
        (stats,) = client.stats().values()
    result.seconds = time.perf_counter() - began
    result.hit_rate = hits / total
    result.evictions = stats["ssd"]["evictions"]
    result.extra = {"blocks_held": stats["ssd"]["entries"], "compactions": stats["compactions"]}
    asyncio.run_coroutine_threadsafe(server.stop(5), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    shutil.rmtree(data, ignore_errors=True)
    return result


def _replay_job(work: Path, policy: str, capacity_blocks: int) -> Replay:
    return replay(_trace(), work, policy, capacity_blocks)


def trace_replay(work: Path, fractions: list[float], plot: Path | None) -> dict[str, Any]:
    """The unbounded run first (it counts the distinct blocks), then each policy and capacity, two at a time.

    The hit rate does not depend on the disk, so the replays keep their data on tmpfs when there is one."""
    if Path("/dev/shm").is_dir():
        work = Path(tempfile.mkdtemp(prefix="cache_bench-", dir="/dev/shm"))
    trace = _trace()
    unbounded = replay(trace, work, "retain-72h", None)
    unique = unbounded.extra["blocks_held"]
    jobs = [(work, policy, max(int(unique * f), 1)) for policy in ("retain-72h", "retain-10min") for f in fractions]
    with mp.get_context("spawn").Pool(2) as pool:
        runs = [unbounded, *pool.starmap(_replay_job, jobs)]
    shutil.rmtree(work, ignore_errors=True)
    out = {
        "requests": len(trace),
        "unique_blocks": unique,
        "unbounded_hit_rate": unbounded.hit_rate,
        "mooncake_paper_hit_rate": MOONCAKE_PAPER_HIT_RATE,
        "runs": [r.__dict__ for r in runs],
    }
    if plot is not None:
        _plot(runs, unique, plot)
    return out


def _plot(runs: list[Replay], unique: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy, style in (("retain-72h", "o-"), ("retain-10min", "s--")):
        points = sorted((r.capacity_blocks, r.hit_rate) for r in runs if r.policy == policy and r.capacity_blocks)
        gb = [c * BLOCK / 1e9 for c, _ in points]
        ax.plot(gb, [h * 100 for _, h in points], style, label=f"ours, {policy}")
    unbounded = next(r for r in runs if r.capacity_blocks is None)
    ax.axhline(unbounded.hit_rate * 100, color="grey", lw=1, label=f"unbounded ({unbounded.hit_rate:.1%})")
    ax.axhline(MOONCAKE_PAPER_HIT_RATE * 100, color="red", lw=1, ls=":", label="Mooncake paper (≈ 40 %)")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:.0f}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([c * BLOCK / 1e9 for c in sorted({r.capacity_blocks for r in runs if r.capacity_blocks})])
    ax.set_xlabel(f"SSD capacity (GB of full-size 56,960 B blocks; {unique:,} distinct blocks in the trace)")
    ax.set_ylabel("prefix hit rate (% of 64-token blocks)")
    ax.set_title("Mooncake conversation trace replayed through cache_svc")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _trace_table(result: dict[str, Any]) -> Table:
    table = Table(title="Mooncake conversation trace: prefix hit rate against capacity")
    for column in ("policy", "capacity (blocks)", "≈ GB full-size", "hit rate", "refused puts", "evictions"):
        table.add_column(column, justify="right")
    for r in result["runs"]:
        cap = r["capacity_blocks"]
        table.add_row(
            r["policy"],
            f"{cap:,}" if cap else "unbounded",
            f"{cap * BLOCK / 1e9:.1f}" if cap else "",
            f"{r['hit_rate']:.1%}",
            str(r["refused_puts"]),
            str(r["evictions"]),
        )
    table.caption = f"unbounded {result['unbounded_hit_rate']:.1%} vs Mooncake paper ≈ 40 %"
    return table


# --- main ---------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(mem / 1e9, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="throughput,restart,trace")
    parser.add_argument("--quick", action="store_true", help="short cells, 100 k blocks, fewer capacities")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per throughput cell")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks on disk for the restart section")
    parser.add_argument("--work-dir", default=None, help="where servers keep their data (default: a temp dir)")
    parser.add_argument("--out", default=str(ROOT / "bench/out/cache_bench.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs/cache_trace_hit_rate.png"))
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON at --out")
    args = parser.parse_args(argv)
    if args.replot:
        trace = json.loads(Path(args.out).read_text())["trace"]
        _plot([Replay(**run) for run in trace["runs"]], trace["unique_blocks"], Path(args.plot))
        return 0
    sections = set(args.sections.split(","))
    with_redis = shutil.which("redis-server") is not None
    if not with_redis:
        console.print("[yellow]redis-server not found (Debian: apt-get install -y redis-server): Redis skipped")
    seconds = 1.0 if args.quick else args.seconds
    blocks = 100_000 if args.quick else args.blocks
    fractions = [0.1, 0.5] if args.quick else [0.05, 0.1, 0.25, 0.5, 0.75]
    out = Path(args.out)
    # Sections not run this time keep their last figures; each section records the machine and load it ran on.
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    run_info = {**machine(), "command": " ".join(["python bench/cache_bench.py", *sys.argv[1:]])}
    work = Path(tempfile.mkdtemp(prefix="cache_bench-", dir=args.work_dir))
    try:
        if "throughput" in sections:
            cells = throughput(work, seconds, [int(c) for c in args.clients.split(",")], with_redis)
            results["throughput"] = [c.__dict__ for c in cells]
            results["throughput_run"] = {**run_info, "load_avg_1m_at_end": os.getloadavg()[0]}
            console.print(_throughput_table(cells))
        if "restart" in sections:
            results["restart"] = restart(work, blocks, 1024, with_redis)
            results["restart_run"] = {**run_info, "load_avg_1m_at_end": os.getloadavg()[0]}
            console.print_json(data=results["restart"])
        if "trace" in sections:
            results["trace"] = trace_replay(work, fractions, Path(args.plot) if args.plot else None)
            results["trace_run"] = {**run_info, "load_avg_1m_at_end": os.getloadavg()[0]}
            console.print(_trace_table(results["trace"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
