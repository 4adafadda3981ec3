"""`python -m prefill_svc serve --ranks 2`: the encoder half as two rank processes (gloo on loopback), each holding half
of the encoder's routed experts, writes the global KV blocks and the handoff state one process writes, byte for
byte."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from service_mesh import WAIT_S, Loop, Served, free_port

from cache_svc.client import CacheClient
from cache_svc.config import CacheConfig, resolve_defaults
from cache_svc.server import CacheServer
from mesh.block_keys import block_keys
from proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc


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


def test_two_ranks_prefill_the_blocks_and_state_of_one(
    serve: Callable[..., Served], caches: Callable[[], str], prompt: Callable, salt: bytes
) -> None:
    results = []
    tokens = prompt(53)
    for ranks in (1, 2):
        cache = caches()
        child = serve(
            "prefill_svc", "--cache", cache, "--dtype", "float64", "--chunk-size", "16", "--metrics-port", "0",
            "--ranks", str(ranks), "--master-port", str(free_port()),
        )  # fmt: skip
        results.append(prefilled(child, cache, tokens, salt))
        assert child.terminate() == 0
    (state, blocks), (state2, blocks2) = results
    assert len(blocks) == 3
    assert None not in blocks
    assert blocks2 == blocks
    assert state
    assert state2 == state
