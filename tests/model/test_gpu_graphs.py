"""On a GPU (skipped without one): the decode step and DSpark's draft and verify replayed from CUDA graphs, one per
batch bucket (and verify width), give the eager forwards' results while sequences join and leave, wait for the device
nowhere but at the end of a verify, and neither capture nor compile anything after their warm-up."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

from decode_svc.sampler import StepSampling
from model import DecodeBatch, build_model, encode_prefill, preset
from model.graphs import MIN_CONTEXT, StepGraphs
from model.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def small():
    return build_model(preset("small"), seed=0, device="cuda", dtype=torch.bfloat16)


def _prompts(model, count: int, seed: int):
    rng = random.Random(seed)
    return [
        encode_prefill(model, [rng.randrange(model.args.vocab_size) for _ in range(rng.randint(20, 90))])
        for _ in range(count)
    ]


def test_graph_steps_give_the_eager_steps_logits_as_sequences_join_and_leave(small):
    prompts = _prompts(small, 6, 0)
    graphed, eager = DecodeBatch(small, 8, graphs=True), DecodeBatch(small, 8, graphs=False)
    ids: dict[str, list[int]] = {"graphed": [], "eager": []}
    pending: list[int] = []
    worst = 0.0

    def join(k: int) -> None:
        for out in prompts[:k]:
            (gid, first), (eid, _) = (
                graphed.join(out.blocks, out.encoder_state),
                eager.join(out.blocks, out.encoder_state),
            )
            ids["graphed"].append(gid)
            ids["eager"].append(eid)
            pending.append(int(first.argmax()))
        del prompts[:k]

    def steps(n: int) -> None:
        nonlocal worst
        for _ in range(n):
            tokens = torch.tensor(pending, device="cuda").unsqueeze(1)
            g, e = graphed.decode_step(tokens).float(), eager.decode_step(tokens).float()
            worst = max(worst, float((g - e).abs().max() / e.abs().max()))
            pending[:] = e.argmax(-1).tolist()

    def leave(i: int) -> None:
        graphed.leave(ids["graphed"].pop(i))
        eager.leave(ids["eager"].pop(i))
        pending.pop(i)

    join(3)
    steps(6)  # bucket 4 (3 rows and a padding row)
    join(2)
    steps(5)  # bucket 8
    leave(1)
    steps(4)
    join(1)
    leave(0)
    leave(2)
    steps(4)  # bucket 4 again: its graph is replayed, not captured anew
    assert graphed.positions() == eager.positions()
    assert worst < 2e-2, worst  # bf16 rounding: a padded GEMM may sum in another order
    assert graphed.graphs.captures == 2


def test_replayed_steps_wait_for_the_device_only_to_read_a_verify_back(small):
    (out,) = _prompts(small, 1, 1)
    batch = DecodeBatch(small, 4, graphs=True)
    for _ in range(3):
        batch.join(out.blocks, out.encoder_state)
    tokens = torch.randint(0, small.args.vocab_size, (3, 1), device="cuda")
    greedy, lengths = SamplingParams.uniform(3), torch.tensor([5, 2, 0])

    def steps() -> Tensor:
        batch.decode_step(tokens)
        draft = batch.dspark_draft(tokens, greedy)
        return batch.verify(tokens, draft, greedy, lengths).logits  # reads its acceptance back by an event

    steps()  # captures bucket 4
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            logits = steps()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(logits.isfinite().all())


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_graph_drafts_and_verifies_replay_their_forwards_bit_for_bit(small, sampled: bool):
    """Drafts and verifies replayed from graphs equal, bit for bit, the same forwards run uncaptured (StepGraphs
    without capture: the rows padded to the same bucket, the same static steps): the same draft probabilities, verify
    logits and accepted tokens, and the same positions after, verify widths changing (each width's graph captured on
    first use, one replayed again later) — greedy rows, and rows at T = 1, 0 and 0.7 racing keyed noise (their
    acceptance the raced accept graph's).

    The twin runs the padded shapes because a plain eager batch of 3 rows is a different computation: without batch
    invariance a GEMM over 4 rows may round a row's last bit unlike one over 3, and in bf16 one such bit can flip an
    expert choice or a top-k pick and move a later position's logits by tens of percent. That the padded static
    forwards equal the plain ones is checked on the CPU in fp64 (tests/model/test_decode_path.py)."""
    prompts = _prompts(small, 3, 4)
    graphed, twin = DecodeBatch(small, 4, graphs=True), DecodeBatch(small, 4, graphs=False)
    twin.graphs = StepGraphs(small, twin.cache, capture=False)
    for batch in (graphed, twin):
        for out in prompts:
            batch.join(out.blocks, out.encoder_state)
    V, cursor = small.args.vocab_size, torch.tensor([10, 0, 7])

    def sampling() -> StepSampling:
        temperature = torch.tensor([1.0, 0.0, 0.7]) if sampled else torch.zeros(3)
        return StepSampling(
            temperature, torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.tensor([3, 4, 5]), cursor.clone()
        )

    pending = torch.randint(0, V, (3, 1), generator=torch.Generator().manual_seed(5)).cuda()
    for width in (5, 2, 5, 1, 3):
        g, t = graphed.dspark_draft(pending, sampling()), twin.dspark_draft(pending, sampling())
        assert torch.equal(g.tokens, t.tokens), width
        assert torch.equal(g.proposal(V), t.proposal(V)), width
        draft = t.trim(width)
        rg, rt = graphed.verify(pending, draft, sampling()), twin.verify(pending, draft, sampling())
        assert torch.equal(rg.logits, rt.logits), (width, float((rg.logits - rt.logits).abs().max()))
        assert rg.tokens == rt.tokens
        cursor += rt.accepted + 1
        pending = torch.tensor([[row[-1]] for row in rt.tokens], device="cuda")
    assert graphed.positions() == twin.positions()


def test_after_warm_up_two_hundred_steps_of_changing_batches_capture_and_compile_nothing(small):
    """Warm-up: the batch grows from 1 to 8 sequences; at each size a decode step and a draft verified at widths 1,
    3 and 5 (buckets 1, 2, 4, 8: their decode, keyed draft, verify and greedy accept graphs captured, the fused
    functions compiled). Then 200 steps, plain or speculative at one of those widths, while sequences join and leave
    at random: no capture, no compilation."""
    prompts = _prompts(small, 3, 2)
    batch = DecodeBatch(small, 8, graphs=True)
    rng = random.Random(3)
    seqs: list[int] = []

    def pending() -> Tensor:
        return torch.randint(0, small.args.vocab_size, (len(seqs), 1), device="cuda")

    def step(width: int) -> None:
        if width == 0:
            logits = batch.decode_step(pending())
            assert logits.shape == (len(seqs), small.args.vocab_size)
            return
        greedy, tokens = SamplingParams.uniform(len(seqs)), pending()
        draft = batch.dspark_draft(tokens, greedy).trim(width)
        result = batch.verify(tokens, draft, greedy)
        assert result.logits.shape == (len(seqs), 1 + width, small.args.vocab_size)

    for _ in range(8):
        out = prompts[rng.randrange(len(prompts))]
        seqs.append(batch.join(out.blocks, out.encoder_state)[0])
        for width in (0, 1, 3, 5):
            step(width)
    captures, compiled = batch.graphs.captures, counters["stats"]["unique_graphs"]
    assert captures == 4 * (2 + 2 * 3)
    for _ in range(200):
        if len(seqs) < 8 and rng.random() < 0.3:
            out = prompts[rng.randrange(len(prompts))]
            seqs.append(batch.join(out.blocks, out.encoder_state)[0])
        elif len(seqs) > 1 and rng.random() < 0.3:
            batch.leave(seqs.pop(rng.randrange(len(seqs))))
        step(rng.choice((0, 1, 3, 5)))
    assert (batch.graphs.captures, counters["stats"]["unique_graphs"]) == (captures, compiled)


def test_steps_after_the_cache_moves_capture_anew_and_give_the_eager_logits(small):
    """A growth of the cache's buffers (here its rows for the widest bucket, then a row's entries past the reserved
    context) drops every graph; the next step captures again, into a fresh memory pool, and gives the eager step's
    logits — and the process's random draws still work after it."""
    graphed, eager = DecodeBatch(small, 3, graphs=True), DecodeBatch(small, 3, graphs=False)
    graphed.capture(())  # buckets 1, 2 and 4 of a cache made for 3 rows
    assert graphed.graphs.captures == 3
    pending = []
    for out in _prompts(small, 3, 7):
        (_, first), _ = graphed.join(out.blocks, out.encoder_state), eager.join(out.blocks, out.encoder_state)
        pending.append(int(first.argmax()))
    worst = 0.0
    for grow in (False, True, False):
        if grow:
            graphed.cache.reserve(len(graphed), 4 * MIN_CONTEXT)
        tokens = torch.tensor(pending, device="cuda").unsqueeze(1)
        g, e = graphed.decode_step(tokens).float(), eager.decode_step(tokens).float()
        worst = max(worst, float((g - e).abs().max() / e.abs().max()))
        pending = e.argmax(-1).tolist()
    assert graphed.graphs.captures == 4  # bucket 4 once more, after the growth
    assert worst < 2e-2, worst
    assert torch.randn(8, device="cuda").isfinite().all()


def test_a_capture_beside_a_thread_copying_to_the_host_succeeds(small):
    """A capture runs on the engine's thread while another may be copying finished sequences' blocks to the host
    (the write-back serialises them on a worker thread): that thread's copies must not void the capture."""
    batch = DecodeBatch(small, 2, graphs=True)
    blocks = torch.randn(1 << 16, device="cuda")
    stop, copies = threading.Event(), []

    def write_back() -> None:
        while not stop.is_set():
            copies.append(blocks.cpu().shape[0])

    thread = threading.Thread(target=write_back)
    thread.start()
    try:
        batch.capture(())  # buckets 1 and 2
    finally:
        stop.set()
        thread.join()
    assert batch.graphs.captures == 2
    assert copies  # the copying thread ran


def test_a_start_up_capture_leaves_nothing_to_capture_later(small):
    """`DecodeBatch.capture` before any sequence: every bucket up to the capacity (1, 2, 4, 8) gets its decode, draft,
    keyed draft and, per width, verify, commit, accept and raced accept graphs; steps of every batch size and width
    then capture nothing."""
    batch = DecodeBatch(small, 8, graphs=True)
    batch.capture((1, 3, 5))
    assert batch.graphs.captures == 4 * (3 + 4 * 3)
    for out in _prompts(small, 5, 5):
        batch.join(out.blocks, out.encoder_state)
        tokens = torch.randint(0, small.args.vocab_size, (len(batch), 1), device="cuda")
        batch.decode_step(tokens)
        greedy = SamplingParams.uniform(len(batch))
        draft = batch.dspark_draft(tokens, greedy)
        for width in (1, 3, 5):
            batch.verify(tokens, draft.trim(width), greedy)
            tokens = torch.randint(0, small.args.vocab_size, (len(batch), 1), device="cuda")
    assert batch.graphs.captures == 4 * (3 + 4 * 3)
