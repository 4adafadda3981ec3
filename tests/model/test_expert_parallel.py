"""Expert parallelism on CPU: W ranks (spawned processes, gloo over a file rendezvous) each hold 1/W of every MoE
layer's routed experts, DSpark's included, and serve exactly what one process holding all of them serves — prefill
outputs, decode logits, DSpark drafts and verification, greedy tokens — bit for bit, on `tiny` (seeded, fp64,
packed and float forms) and on the trained `demo` checkpoint (fp32, each rank reading its own experts only).

With replicated attention every rank runs the same batch (`model.parallel`), so every rank's outputs are compared;
with data-parallel attention each rank decodes its own sequences, and their tokens together are compared.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import (
    DecodeBatch,
    ModelArgs,
    SamplingParams,
    Transformer,
    build_model,
    encode_prefill,
    load_checkpoint,
    preset,
)
from model.moe import MoE
from model.parallel import Parallel
from model.weights import expected_names, weight_bytes

DEMO = Path(__file__).resolve().parents[2] / "model" / "checkpoints" / "v41-demo"
PROMPTS = (23, 40, 9)  # prompt lengths: 3 sequences, so at W = 4 one rank's share of a decode step is empty
EXPERT = re.compile(r"(.+\.ffn)\.experts\.(\d+)\.")
# Per group size, the models a group serves: (preset, packed form).
CASES = {2: [("tiny", True), ("tiny", False), ("demo", True)], 4: [("tiny", True), ("demo", True)]}


def build(name: str, parallel: Parallel, packed: bool = True) -> Transformer:
    """The model under test: `tiny` seeded in fp64, or the demo checkpoint in fp32."""
    if name == "demo":
        return load_checkpoint(DEMO, packed=packed, parallel=parallel)
    return build_model(preset("tiny"), seed=0, dtype=torch.float64, packed=packed, parallel=parallel)


def serve(model: Transformer, steps: int = 2) -> dict[str, list]:
    """Prefill the prompts, join them into one decode batch, decode greedily, then speculate with DSpark (greedy):
    every output on the way."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=g) for n in PROMPTS]
    greedy = SamplingParams.uniform(len(prompts))
    out: dict[str, list] = {"prefill": [], "decode": [], "draft": [], "verify": [], "tokens": []}
    with torch.no_grad():
        prefilled = [encode_prefill(model, p) for p in prompts]
        for p in prefilled:
            out["prefill"] += [b.to_bytes() for b in p.blocks] + [p.encoder_state.to_bytes()]
        batch = DecodeBatch(model, len(prompts))
        logits = torch.stack([row for _, row in batch.join_many([(p.blocks, p.encoder_state) for p in prefilled])])
        for _ in range(steps):
            out["decode"].append(logits)
            pending = logits.argmax(-1).tolist()
            out["tokens"].append(pending)
            logits = batch.decode_step(pending)
        pending = logits.argmax(-1).tolist()
        for _ in range(steps):
            draft = batch.dspark_draft(pending, greedy)
            result = batch.verify(pending, draft, greedy)
            out["draft"] += [draft.tokens, draft.probs, draft.confidence]
            out["verify"].append(result.logits)
            out["tokens"] += result.tokens
            pending = [row[-1] for row in result.tokens]
    return out


def held_experts(model: Transformer) -> dict[str, object]:
    """What a rank holds and read: per MoE layer, the global ids of the routed experts whose checkpoint tensors it
    takes; the bytes of its routed experts; (from a checkpoint) the bytes its loader read."""
    ids: dict[str, set[int]] = {}
    for name in expected_names(model):
        if m := EXPERT.match(name):
            ids.setdefault(m.group(1), set()).add(int(m.group(2)))
    routed = sum(weight_bytes(moe.experts) for moe in model.modules() if isinstance(moe, MoE))
    report = getattr(model, "load_report", None)
    return {"ids": ids, "routed_bytes": routed, "read_bytes": report.read_bytes if report else None}


def rank_main(rank: int, world: int, directory: str) -> None:
    """One rank: join the group; per model of CASES[world], build its share of it and serve; write what it got."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world)
    try:
        results = {}
        for name, packed in CASES[world]:
            model = build(name, Parallel(world, rank), packed)
            results[name, packed] = {"outputs": serve(model), "held": held_experts(model)}
        torch.save(results, f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def assert_identical(case: str, expected: dict[str, list], got: dict[str, list]) -> None:
    """Every output the same bits (tensors) or values (bytes, token lists)."""
    assert expected.keys() == got.keys()
    for key, values in expected.items():
        assert len(values) == len(got[key]), f"{case}: {key}"
        for i, (a, b) in enumerate(zip(values, got[key], strict=True)):
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            assert same, f"{case}: {key}[{i}] differs"


@pytest.fixture(scope="module")
def single() -> Callable[[str, bool], dict]:
    """EP = 1 results (one process, no process group), computed once per model."""
    cache: dict[tuple[str, bool], dict] = {}

    def get(name: str, packed: bool) -> dict:
        if (name, packed) not in cache:
            model = build(name, Parallel(), packed)
            cache[name, packed] = {"outputs": serve(model), "held": held_experts(model)}
        return cache[name, packed]

    return get


@pytest.mark.parametrize("world", CASES)
def test_expert_parallel_equals_one_rank_bit_for_bit(tmp_path, single, world):
    """One group of W spawned ranks serves every model of CASES[W]; each rank's outputs, experts and reads are
    checked against the single process's."""
    mp.spawn(rank_main, args=(world, str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for name, packed in CASES[world]:
        case = f"{name} ({'packed' if packed else 'float'}) at W = {world}"
        check_case(case, single(name, packed), [results[name, packed] for results in ranks], preset(name))


def check_case(case: str, expected: dict, ranks: list[dict], args: ModelArgs) -> None:
    """Every rank served the single process's bits, held experts [r·E/W, (r+1)·E/W) of each MoE layer (E: the
    backbone's or DSpark's) and no other, and — from a checkpoint — read its own experts and every other tensor."""
    world, every = len(ranks), expected["held"]["ids"]
    assert len(every) == args.n_layers_total, case  # every MoE layer, DSpark's included
    for rank, result in enumerate(ranks):
        assert_identical(f"{case}, rank {rank}", expected["outputs"], result["outputs"])
        share = {layer: set(range(rank * len(e) // world, (rank + 1) * len(e) // world)) for layer, e in every.items()}
        assert result["held"]["ids"] == share, case
        assert result["held"]["routed_bytes"] * world == expected["held"]["routed_bytes"], case
    if expected["held"]["read_bytes"] is not None:
        routed = expected["held"]["routed_bytes"]
        others = expected["held"]["read_bytes"] - routed
        assert [r["held"]["read_bytes"] for r in ranks] == [others + routed // world] * world, case


def sampled_rank_main(rank: int, world: int, directory: str) -> None:
    """One rank verifying DSpark drafts at T = 1 with a generator seeded by its rank: what it emitted and where its
    sequences stand after each round."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world)
    try:
        model = build("tiny", Parallel(world, rank))
        g = torch.Generator().manual_seed(7)
        prompts = [encode_prefill(model, torch.randint(0, model.args.vocab_size, (n,), generator=g)) for n in PROMPTS]
        batch = DecodeBatch(model, len(prompts))
        joined = batch.join_many([(p.blocks, p.encoder_state) for p in prompts])
        pending = [int(logits.argmax()) for _, logits in joined]
        greedy, sampled = SamplingParams.uniform(len(prompts)), SamplingParams.uniform(len(prompts), temperature=1.0)
        mine = torch.Generator().manual_seed(100 + rank)
        rounds = []
        with torch.no_grad():
            for _ in range(4):
                draft = batch.dspark_draft(pending, greedy)  # greedy: the same drafts on every rank
                result = batch.verify(pending, draft, sampled, generator=mine)
                rounds.append((result.tokens, batch.positions()))
                pending = [row[-1] for row in result.tokens]
        torch.save(rounds, f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_every_rank_commits_rank_0s_sampled_acceptance(tmp_path):
    """Each rank draws its acceptances from a generator of its own; the group still emits, and commits, rank 0's:
    the same tokens and positions on every rank, round after round."""
    mp.spawn(sampled_rank_main, args=(2, str(tmp_path)), nprocs=2)
    first, second = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert first == second


def spread(model: Transformer, mine: dict[int, torch.Tensor], left: int, steps: int = 2) -> dict[int, list[int]]:
    """Data-parallel attention: prefill the prompts this rank holds (by index), join them, then twice: decode
    greedily, speculate with DSpark (greedy); sequence `left` leaves after the first round. A rank with no sequence
    runs no forward; every rank answers the others' MoE rounds after each call (`serve_idle`), so a rank whose
    sequences all left, or that never had any, still serves its experts. Each sequence's tokens by prompt index."""
    idle = model.serve_idle if model.parallel.data_parallel else lambda: None
    with torch.no_grad():
        prefilled = {i: encode_prefill(model, p) for i, p in mine.items()}
        idle()
        batch = DecodeBatch(model, len(PROMPTS))
        joined = batch.join_many([(p.blocks, p.encoder_state) for p in prefilled.values()]) if mine else []
        idle()
        index = {seq_id: i for (seq_id, _), i in zip(joined, mine, strict=True)}
        out = {i: [int(logits.argmax())] for (_, logits), i in zip(joined, mine, strict=True)}
        for round_ in range(2):
            for _ in range(steps):
                if len(batch):
                    logits = batch.decode_step([out[index[s]][-1] for s in batch.seq_ids])
                    for s, row in zip(batch.seq_ids, logits, strict=True):
                        out[index[s]].append(int(row.argmax()))
                idle()
            for _ in range(steps):
                if len(batch):
                    pending, greedy = [out[index[s]][-1] for s in batch.seq_ids], SamplingParams.uniform(len(batch))
                    result = batch.verify(pending, batch.dspark_draft(pending, greedy), greedy)
                    for s, tokens in zip(batch.seq_ids, result.tokens, strict=True):
                        out[index[s]] += tokens
                idle()
            if round_ == 0 and left in mine:
                batch.leave(next(s for s, i in index.items() if i == left))
    return out


def spread_prompts(model: Transformer) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, model.args.vocab_size, (n,), generator=g) for n in PROMPTS]


def spread_rank_main(rank: int, world: int, directory: str) -> None:
    """One rank of a data-parallel group on `tiny`: prompt i is rank i mod W's; prompt 1 leaves after a round."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world)
    try:
        model = build("tiny", Parallel(world, rank, data_parallel=True))
        mine = {i: p for i, p in enumerate(spread_prompts(model)) if i % world == rank}
        torch.save(spread(model, mine, left=1), f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_ranks_decode_the_tokens_of_one_batch(tmp_path, world):
    """Each rank decodes its own sequences (at W = 4 one rank never holds any; at both sizes rank 1 holds none after
    its sequence left): together they emit the greedy tokens one process emits for the whole batch."""
    model = build("tiny", Parallel())
    expected = spread(model, dict(enumerate(spread_prompts(model))), left=1)
    mp.spawn(spread_rank_main, args=(world, str(tmp_path)), nprocs=world)
    got: dict[int, list[int]] = {}
    for r in range(world):
        got |= torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
    assert got == expected
    assert len(expected[1]) < len(expected[0])  # the sequence that left stopped early
