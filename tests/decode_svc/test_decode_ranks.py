"""`python -m decode_svc serve --ranks 2`: a replica as a group of two rank processes (gloo on loopback), each holding
half of every MoE layer's routed experts and decoding its own sequences, serves the greedy tokens one process serves —
through local prefill, the plain lane and DSpark's draft and verify — and twice the sequences of one; a rank killed
mid-stream ends the stream with UNAVAILABLE within seconds and the whole group exits non-zero; a group the model
cannot be split over is refused at start."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest
import torch
from service_mesh import WAIT_S, Served, free_port, metric_value, run_cli, token_ids, wait_until

from model.config import preset
from model.engram_store import table_bytes
from proto.decode.v1 import decode_pb2, decode_pb2_grpc

FAILURE_S = 10.0  # the group must fail within this of a rank's death


def ranked(serve: Callable[..., Served], ranks: int, *flags: str, serving: bool = True) -> Served:
    """A decode replica of `ranks` rank processes on `tiny` in float64, every speculative step drafting (a later
    --master-port in `flags` wins)."""
    group = ["--ranks", str(ranks), "--master-port", str(free_port())]
    flags = ("--dtype", "float64", "--draft-policy", "full", "--metrics-port", "0", *group, *flags)
    return serve("decode_svc", *flags, serving=serving)


def stream(child: Served, prompt: list[int], speculate: bool) -> grpc.Future:
    """A greedy generation that runs until cancelled (max_tokens 0: as long as the context allows)."""
    channel = grpc.insecure_channel(child.address)
    request = decode_pb2.GenerateRequest(token_ids=token_ids(prompt), disable_speculation=not speculate)
    return decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=WAIT_S)


def load(child: Served) -> decode_pb2.Load:
    with grpc.insecure_channel(child.address) as channel:
        return decode_pb2_grpc.DecodeStub(channel).GetLoad(decode_pb2.GetLoadRequest(), timeout=WAIT_S)


def generate(
    child: Served,
    prompt: list[int],
    max_tokens: int,
    speculate: bool,
    seed: int | None,
    constraint: decode_pb2.OutputConstraint | None = None,
) -> list[int]:
    """Greedy tokens, or (seed) tokens sampled at temperature 0.8, reproducibly; under `constraint` if given."""
    sampling = decode_pb2.SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed)
    with grpc.insecure_channel(child.address) as channel:
        request = decode_pb2.GenerateRequest(
            token_ids=token_ids(prompt),
            max_tokens=max_tokens,
            sampling=sampling,
            disable_speculation=not speculate,
            constraint=constraint,
        )
        return [t for m in decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=WAIT_S) for t in m.token_ids]


def usage(child: Served, prompt: list[int], max_tokens: int, constraint: decode_pb2.OutputConstraint) -> Any:
    """The usage of a greedy generation under `constraint`, DSpark on."""
    with grpc.insecure_channel(child.address) as channel:
        request = decode_pb2.GenerateRequest(token_ids=token_ids(prompt), max_tokens=max_tokens, constraint=constraint)
        return list(decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=WAIT_S))[-1].usage


def logprobs(child: Served, prompt: list[int], max_tokens: int) -> list[float]:
    """The logprobs of a greedy generation's tokens, DSpark on."""
    with grpc.insecure_channel(child.address) as channel:
        request = decode_pb2.GenerateRequest(token_ids=token_ids(prompt), max_tokens=max_tokens, logprobs=True)
        stream = decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=WAIT_S)
        return [t.logprob for m in stream for t in m.logprobs]


def test_two_ranks_generate_the_tokens_of_one(serve: Callable[..., Served], prompt: Callable) -> None:
    one, two = ranked(serve, 1), ranked(serve, 2)
    assert "ranks_spawned" not in one.seen
    assert len(two.seen["ranks_spawned"]["pids"]) == 1  # rank 0 is the service process itself
    for p, seed in ((prompt(40), None), (prompt(23), 5)):
        for speculate in (True, False):
            tokens = generate(one, p, 12, speculate, seed)
            assert len(tokens) == 12
            assert generate(two, p, 12, speculate, seed) == tokens, (speculate, seed)


def test_a_group_over_two_nodes_generates_the_tokens_of_one(serve: Callable[..., Served], prompt: Callable) -> None:
    """--nodes 2 (a process a node, on loopback): node 0 serves and plans, node 1 follows its plans with half the
    experts and sequences of its own, and leaves when node 0 stops."""
    group = ["--nodes", "2", "--master-port", str(free_port())]
    follower = ranked(serve, 1, *group, "--node-rank", "1", serving=False)
    leader = ranked(serve, 1, *group)
    assert follower.wait_for("model_loaded")["rank"] == 1
    one = ranked(serve, 1)
    for p, speculate in ((prompt(40), True), (prompt(23), False)):
        tokens = generate(one, p, 12, speculate, None)
        assert generate(leader, p, 12, speculate, None) == tokens, speculate
    assert leader.terminate() == 0
    assert follower.proc.wait(timeout=WAIT_S) == 0


def test_a_group_spreads_its_sequences_over_its_ranks(serve: Callable[..., Served], prompt: Callable) -> None:
    """With --max-batch 1 a rank holds one sequence: a group of two runs two streams at once, one on each rank (the
    rank_rows gauge), where one rank runs one and queues the other. Beside a stream on rank 0, rank 1 decodes the
    greedy tokens one process decodes, DSpark on and off, under an output constraint (a banned token: speculating),
    and reports its logprobs
    (from its row's logits alone, which a verify gathers to rank 0)."""
    metrics = free_port()
    one = ranked(serve, 1, "--max-batch", "1")
    two = ranked(serve, 2, "--max-batch", "1", "--metrics-port", str(metrics))

    def rows(rank: int) -> float:
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=WAIT_S).text
        return metric_value(text, "v41mesh_decode_rank_rows", f'rank="{rank}"')

    first, second = stream(two, prompt(30), speculate=True), stream(two, prompt(31), speculate=False)
    next(first), next(second)  # both decode: the speculative lane's row on rank 0, the plain lane's on rank 1
    assert (load(two).running, load(two).queue_depth, load(two).max_batch) == (2, 0, 2)
    assert (rows(0), rows(1)) == (1, 1)
    second.cancel()
    wait_until(lambda: rows(1) == 0, "rank 1 to let its sequence go")
    for p, speculate in ((prompt(40), True), (prompt(23), False)):
        assert generate(two, p, 12, speculate, None) == generate(one, p, 12, speculate, None), speculate
    p = prompt(35)
    assert logprobs(two, p, 8) == pytest.approx(logprobs(one, p, 8), abs=1e-4)
    words = decode_pb2.OutputConstraint(regex="[a-z ]+")  # rank 0 masks what rank 1 decodes
    p = prompt(33)
    assert generate(two, p, 12, False, None, words) == generate(one, p, 12, False, None, words)
    ban = decode_pb2.OutputConstraint(banned_token_ids=[generate(one, p, 12, True, None)[2]])
    banned = generate(two, p, 12, True, None, ban)  # rank 1 masks its row's drafts and verify itself
    assert banned == generate(one, p, 12, True, None, ban)
    assert ban.banned_token_ids[0] not in banned
    assert usage(two, p, 12, ban).draft_tokens_proposed > 0  # in the speculative lane
    first.cancel()

    alone = [stream(one, prompt(30), speculate=True)]
    next(alone[0])  # admitted first: the second stream, sent only now, cannot take the only row before it
    alone.append(stream(one, prompt(31), speculate=False))
    wait_until(lambda: load(one).queue_depth == 1, "the second stream to wait for the only rank")
    assert (load(one).running, load(one).max_batch) == (1, 1)
    for s in alone:
        s.cancel()


def table_files(pid: int) -> set[tuple[str, int]]:
    """The shared Engram table files process `pid` maps: (device:inode, bytes mapped)."""
    with open(f"/proc/{pid}/maps") as fh:
        lines = [line.split() for line in fh if "memfd:v41mesh-engram-tables" in line]
    return {(f"{f[3]}:{f[4]}", int(f[0].split("-")[1], 16) - int(f[0].split("-")[0], 16)) for f in lines}


def test_a_group_keeps_one_copy_of_its_host_engram_tables(serve: Callable[..., Served], prompt: Callable) -> None:
    """--engram-store host: the ranks of a node map one table file (the same file in both processes, as big as the
    tables), which rank 0 fills, and decode the tokens one process decodes from tables of its own."""
    one = ranked(serve, 1, "--engram-store", "host")
    two = ranked(serve, 2, "--engram-store", "host")
    assert table_files(one.proc.pid) == set()
    (follower,) = two.seen["ranks_spawned"]["pids"]
    files = table_files(two.proc.pid)
    assert len(files) == 1
    assert table_files(follower) == files
    (_, mapped), tables = files.pop(), table_bytes(preset("tiny"), torch.float64)
    assert tables <= mapped < tables + 16 * 4096  # each of the tables' tensors starts on a page
    assert two.seen["model_loaded"]["engram_store"] == "host"
    for p, speculate in ((prompt(40), True), (prompt(23), False)):
        assert generate(two, p, 12, speculate, None) == generate(one, p, 12, speculate, None), speculate


def test_a_killed_rank_ends_the_stream_unavailable_and_the_group_exits(
    serve: Callable[..., Served], prompt: Callable
) -> None:
    child = ranked(serve, 2)
    (follower,) = child.seen["ranks_spawned"]["pids"]
    with grpc.insecure_channel(child.address) as channel:
        request = decode_pb2.GenerateRequest(token_ids=token_ids(prompt(30)), max_tokens=4000)
        stream = decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=WAIT_S)
        next(stream)  # the stream runs
        os.kill(follower, 9)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            for _ in stream:
                pass
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value.details()
    assert time.monotonic() - killed < FAILURE_S
    assert "rank 1" in error.value.details()
    assert child.proc.wait(timeout=FAILURE_S) == 1
    assert child.wait_for("rank_group_failed")["reason"].startswith(f"rank 1 (pid {follower}) exited")


def test_a_group_the_experts_do_not_split_over_is_refused_at_start() -> None:
    done = run_cli("decode_svc", "serve", "--model", "tiny", "--port", "0", "--metrics-port", "0", "--ranks", "3")
    assert done.returncode == 1
    assert "3 ranks do not divide the model's 4 routed experts" in done.stderr


def test_a_node_rank_outside_the_group_is_a_usage_error() -> None:
    done = run_cli("decode_svc", "serve", "--nodes", "2", "--node-rank", "2")
    assert done.returncode == 2
    assert "node_rank 2 is outside a group of 2 nodes" in done.stderr


def test_a_silent_rank_fails_the_group_within_its_timeout(serve: Callable[..., Served], prompt: Callable) -> None:
    child = ranked(serve, 2, "--rank-timeout-s", "2")
    (follower,) = child.seen["ranks_spawned"]["pids"]
    with grpc.insecure_channel(child.address) as channel:
        request = decode_pb2.GenerateRequest(token_ids=token_ids(prompt(30)), max_tokens=4000)
        stream = decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=WAIT_S)
        next(stream)
        os.kill(follower, signal.SIGSTOP)  # alive, but answers nothing: the heartbeat stops
        stopped = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            for _ in stream:
                pass
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value.details()
    assert time.monotonic() - stopped < FAILURE_S
    assert child.proc.wait(timeout=FAILURE_S) == 1
    assert "rank 1 has not answered for 2 s" in child.wait_for("rank_group_failed")["reason"]
    assert not alive(follower)  # killed by rank 0 even while stopped


def test_the_ranks_exit_when_the_service_process_dies(serve: Callable[..., Served]) -> None:
    child = ranked(serve, 2)
    (follower,) = child.seen["ranks_spawned"]["pids"]
    child.proc.kill()
    deadline = time.monotonic() + FAILURE_S
    while alive(follower):
        assert time.monotonic() < deadline, "the rank outlived its group's rank 0"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_cpu_ranks_share_the_cores_unless_told() -> None:
    """On the CPU each of W ranks takes its share of the cores (W ranks of torch's default would each take them
    all); --threads overrides it; a single process keeps torch's default (0: nothing set)."""
    from decode_svc.config import DecodeConfig
    from model_service.runtime import cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(DecodeConfig(ranks=2), "cpu") == max(1, cores // 2)
    assert cpu_threads(DecodeConfig(ranks=4), "cpu") == max(1, cores // 4)
    assert cpu_threads(DecodeConfig(ranks=2, threads=3), "cpu") == 3
    assert cpu_threads(DecodeConfig(), "cpu") == 0
