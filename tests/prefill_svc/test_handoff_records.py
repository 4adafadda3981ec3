"""The n handoff records of one prefill on real cache replicas: one stored payload for all n, a stopped replica that
costs only its handles, and a batch that cannot be stored in full leaving no record behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from service_mesh import Loop, Mesh

from cache_svc.client import CacheClient
from cache_svc.config import CacheConfig, resolve_defaults
from cache_svc.server import CacheServer
from model import Transformer, encode_prefill
from proto.prefill.v1 import prefill_pb2

N = 16  # the prefill's --max-handoffs


@pytest.fixture
def replicas(loop: Loop, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """`replicas(record_bytes=..., stopped=False)` → the address of a cache replica of the test's own (started, and
    stopped again at once when `stopped`: a replica that went away)."""
    running: list[CacheServer] = []

    def start(record_bytes: int = 64 << 20, stopped: bool = False) -> str:
        data_dir = tmp_path / f"replica-{len(running)}"
        sizes = {"ssd_bytes": 64 << 20, "dram_bytes": 16 << 20, "record_bytes": record_bytes}
        server = CacheServer(resolve_defaults(CacheConfig(port=0, data_dir=str(data_dir), **sizes)))
        loop.call(server.start())
        address = f"127.0.0.1:{server.port}"
        if stopped:
            loop.call(server.stop(0))
        else:
            running.append(server)
        return address

    yield start
    for server in running:
        loop.call(server.stop(5))


def _handoff_bytes(models: tuple[Transformer, Transformer], ids: list[int], salt: bytes) -> int:
    state = encode_prefill(models[0], ids, chunk_tokens=16).encoder_state.to_bytes()
    return prefill_pb2.Handoff(token_ids=ids, cache_salt=salt, encoder_state=state).ByteSize()


def test_n_handoffs_are_one_payload_in_the_cache(
    start_mesh: Callable[..., Mesh], salt: bytes, prompt: Callable
) -> None:
    mesh = start_mesh()
    answer = mesh.prefill_tokens(prompt(40), salt, handoffs=N)
    with mesh.cache_client() as cache:
        (stats,) = cache.stats().values()
        payload = cache.get_record(answer.handles[0])
        assert payload is not None
        assert (stats["records"]["entries"], stats["records"]["bytes"]) == (N, len(payload))  # not N × the bytes
        assert stats["record_put_bytes"] == len(payload)  # sent once
        assert all(cache.get_record(h, consume=True) == payload for h in answer.handles)
        (stats,) = cache.stats().values()
    assert (stats["records"]["entries"], stats["records"]["bytes"]) == (0, 0)  # the last consume freed it


def test_a_stopped_replica_costs_only_its_handles(
    start_mesh: Callable[..., Mesh], replicas: Callable[..., str], salt: bytes, prompt: Callable
) -> None:
    live, gone = replicas(), replicas(stopped=True)
    mesh = start_mesh(cache=[live, gone])
    answer = mesh.prefill_tokens(prompt(40), salt, handoffs=N)
    with CacheClient([live, gone], timeout_s=60) as cache:
        assert {cache.ring.node(h) for h in answer.handles} == {live}  # redrawn on the replica that answers
        assert len(set(answer.handles)) == N
        stats = cache.stats()[live]
        assert stats["records"]["entries"] == N
        # at most two copies: the first attempt's handles that landed here, and the redrawn ones
        assert stats["record_put_bytes"] == stats["records"]["bytes"] <= 2 * len(cache.get_record(answer.handle) or b"")


def test_a_batch_that_cannot_be_stored_in_full_leaves_no_record_behind(
    start_mesh: Callable[..., Mesh],
    replicas: Callable[..., str],
    models: tuple[Transformer, Transformer],
    salt: bytes,
    prompt: Callable,
) -> None:
    """Two of three replicas stopped; the live one has room for one copy of the handoff. The first attempt stores the
    handles it owns, the stopped replicas' handles are redrawn onto it, which cannot take a second copy: the batch
    fails and the handles it did store are deleted (DeleteRecords), not left pinned until their lease ends."""
    ids = prompt(20)
    live = replicas(record_bytes=_handoff_bytes(models, ids, salt) * 3 // 2)
    mesh = start_mesh(cache=[live, replicas(stopped=True), replicas(stopped=True)])
    with pytest.raises(grpc.RpcError) as failed:
        mesh.prefill_tokens(ids, salt, handoffs=N)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "record pool full" in failed.value.details()
    with CacheClient(live, timeout_s=60) as cache:
        (stats,) = cache.stats().values()
    assert (stats["records"]["entries"], stats["records"]["bytes"]) == (0, 0)
    assert stats["record_deletions"] > 0  # written, then deleted
    assert stats["record_expiries"] == 0


def test_handoff_records_of_an_old_batch_block_a_new_one_until_deleted(
    start_mesh: Callable[..., Mesh], models: tuple[Transformer, Transformer], salt: bytes, prompt: Callable
) -> None:
    """A pool with room for one handoff: all N records of a prefill fit (one payload); the next prefill's do not
    while those are pinned, and leave nothing behind; once they are deleted it fits."""
    ids = prompt(20)
    mesh = start_mesh(cache_options={"record_bytes": _handoff_bytes(models, ids, salt) * 3 // 2})
    first = mesh.prefill_tokens(ids, salt, handoffs=N)
    with pytest.raises(grpc.RpcError) as full:
        mesh.prefill_tokens(ids, salt, handoffs=N)
    assert full.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "record pool full" in full.value.details()
    with mesh.cache_client() as cache:
        assert cache.stats()[mesh.cache_addresses[0]]["records"]["entries"] == N
        assert cache.delete_records(list(first.handles)) == N
    assert len(mesh.prefill_tokens(ids, salt, handoffs=N).handles) == N
