"""`python -m prefill_svc serve --ranks 2`: the encoder half as two rank processes (gloo on loopback), each holding half
of the encoder's routed experts and prefilling prompts of its own, writes the global KV blocks and the handoff state
one process writes, byte for byte; prompts that wait together run in one pass, one on each rank."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from service_mesh import WAIT_S, Loop, Served, free_port, metric_value, wait_until

from cache_svc.client import CacheClient
from cache_svc.config import CacheConfig, resolve_defaults
from cache_svc.server import CacheServer
from mesh.block_keys import block_keys
from proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

FAILURE_S = 10.0  # the group must fail within this of a rank's death


@pytest.fixture
def caches(loop: Loop, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """`cache()` → the address of a fresh cache replica of the test's own."""
    started: list[CacheServer] = []

    def start() -> str:
        sizes = {"ssd_bytes": 64 << 20, "record_bytes": 64 << 20, "dram_bytes": 64 << 20}
        server = CacheServer(resolve_defaults(CacheConfig(port=0, data_dir=str(tmp_path / str(len(started))), **sizes)))
        loop.call(server.start())
        started.append(server)
        return f"127.0.0.1:{server.port}"

    yield start
    for server in started:
        loop.call(server.stop(5))


def prefilled(child: Served, cache: str, tokens: list[int], salt: bytes) -> tuple[bytes, list[bytes | None]]:
    """Prefill `tokens` → (the handoff's encoder state, the prompt's global KV blocks as the cache holds them)."""
    with grpc.insecure_channel(child.address) as channel:
        request = prefill_pb2.PrefillRequest(token_ids=tokens, cache_salt=salt)
        handle = prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=WAIT_S).handle
    loaded = child.seen["model_loaded"]
    keys = block_keys(
        tokens, block_tokens=loaded["kv_block_tokens"], fingerprint=bytes.fromhex(loaded["fingerprint"]), salt=salt
    )
    client = CacheClient([cache])
    try:
        handoff = prefill_pb2.Handoff.FromString(client.get_record(handle) or b"")
        return handoff.encoder_state, client.get_blocks(keys)
    finally:
        client.close()


def prefill_three(
    serve: Callable[..., Served], cache: str, ranks: int, prompts: list[list[int]], salt: bytes
) -> tuple[list[tuple[bytes, list[bytes | None]]], float]:
    """Prefill the first prompt, then the others at once while it runs → (each one's results, encoder passes)."""
    metrics = free_port()
    child = serve(
        "prefill_svc", "--cache", cache, "--dtype", "float64", "--chunk-size", "16", "--metrics-port", str(metrics),
        "--ranks", str(ranks), "--master-port", str(free_port()),
    )  # fmt: skip

    def metric(name: str) -> float:
        return metric_value(httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=WAIT_S).text, name)

    with ThreadPoolExecutor(len(prompts)) as pool:
        first = pool.submit(prefilled, child, cache, prompts[0], salt)
        wait_until(lambda: metric("v41mesh_prefill_running") == 1, "the first prompt to run")
        rest = [pool.submit(prefilled, child, cache, tokens, salt) for tokens in prompts[1:]]
        results = [f.result() for f in (first, *rest)]
    passes = metric("v41mesh_prefill_pass_prompts_count")
    assert child.terminate() == 0
    return results, passes


def test_two_ranks_prefill_the_blocks_and_state_of_one(
    serve: Callable[..., Served], caches: Callable[[], str], prompt: Callable, salt: bytes
) -> None:
    prompts = [prompt(400), prompt(53), prompt(40)]
    one, passes = prefill_three(serve, caches(), 1, prompts, salt)
    assert passes == 3
    two, passes = prefill_three(serve, caches(), 2, prompts, salt)
    assert passes == 2  # the last two prompts in one pass, one on each rank
    for (state, blocks), (state2, blocks2), tokens in zip(one, two, prompts, strict=True):
        assert len(blocks) == len(tokens) // 16
        assert None not in blocks
        assert blocks2 == blocks
        assert state
        assert state2 == state


def test_a_killed_rank_ends_the_prefill_unavailable_and_the_group_exits(
    serve: Callable[..., Served], caches: Callable[[], str], prompt: Callable, salt: bytes
) -> None:
    """A follower killed while a long prompt is in its encoder pass: the caller gets UNAVAILABLE naming the rank within
    seconds, and the group's service process exits non-zero for its supervisor to restart it."""
    metrics = free_port()
    child = serve(
        "prefill_svc", "--cache", caches(), "--dtype", "float64", "--chunk-size", "16", "--metrics-port", str(metrics),
        "--ranks", "2", "--master-port", str(free_port()),
    )  # fmt: skip
    (follower,) = child.seen["ranks_spawned"]["pids"]
    running = lambda: metric_value(httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=WAIT_S).text,  # noqa: E731
                                   "v41mesh_prefill_running")  # fmt: skip
    with grpc.insecure_channel(child.address) as channel, ThreadPoolExecutor(1) as pool:
        request = prefill_pb2.PrefillRequest(token_ids=prompt(4000), cache_salt=salt)
        call = pool.submit(prefill_pb2_grpc.PrefillStub(channel).Prefill, request, timeout=WAIT_S)
        wait_until(lambda: running() == 1, "the prompt to run")
        os.kill(follower, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            call.result()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value.details()
    assert time.monotonic() - killed < FAILURE_S
    assert "rank 1" in error.value.details()
    assert child.proc.wait(timeout=FAILURE_S) == 1
