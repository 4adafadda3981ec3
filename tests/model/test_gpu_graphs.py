"""On a GPU (skipped without one): the decode step replayed from CUDA graphs, one per batch bucket, gives the eager
step's logits while sequences join and leave, waits for the device nowhere, and neither captures nor compiles
anything after its warm-up."""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters

from model import DecodeBatch, build_model, encode_prefill, preset

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


def test_a_replayed_step_never_waits_for_the_device(small):
    (out,) = _prompts(small, 1, 1)
    batch = DecodeBatch(small, 4, graphs=True)
    for _ in range(3):
        batch.join(out.blocks, out.encoder_state)
    tokens = torch.randint(0, small.args.vocab_size, (3, 1), device="cuda")
    batch.decode_step(tokens)  # captures bucket 4
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            logits = batch.decode_step(tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(logits.isfinite().all())


def test_after_warm_up_two_hundred_steps_of_changing_batches_capture_and_compile_nothing(small):
    """Warm-up: the batch grows from 1 to 8 sequences, one step at each size (buckets 1, 2, 4, 8 captured, the fused
    functions compiled). Then 200 steps while sequences join and leave at random: no capture, no compilation."""
    prompts = _prompts(small, 3, 2)
    batch = DecodeBatch(small, 8, graphs=True)
    rng = random.Random(3)
    seqs: list[int] = []

    def step() -> None:
        logits = batch.decode_step(torch.randint(0, small.args.vocab_size, (len(seqs), 1), device="cuda"))
        assert logits.shape == (len(seqs), small.args.vocab_size)

    for _ in range(8):
        out = prompts[rng.randrange(len(prompts))]
        seqs.append(batch.join(out.blocks, out.encoder_state)[0])
        step()
    captures, compiled = batch.graphs.captures, counters["stats"]["unique_graphs"]
    assert captures == 4
    for _ in range(200):
        if len(seqs) < 8 and rng.random() < 0.3:
            out = prompts[rng.randrange(len(prompts))]
            seqs.append(batch.join(out.blocks, out.encoder_state)[0])
        elif len(seqs) > 1 and rng.random() < 0.3:
            batch.leave(seqs.pop(rng.randrange(len(seqs))))
        step()
    assert (batch.graphs.captures, counters["stats"]["unique_graphs"]) == (captures, compiled)
