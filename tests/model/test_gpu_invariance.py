"""On a GPU (skipped without one), under batch invariance: speculation is exact.

- The verify pass over [y, w drafts] of B sequences gives each position the logits bit for bit that B plain steps
  give it (`small`, bf16, graphs and eager; drafts teacher-forced from the plain tokens), at B = 1 and 24.
- Greedy DSpark decoding of the demo checkpoint (its own drafts, every one verified) emits plain greedy decoding's
  tokens, at B = 1 and 24.
- Each kernel of a sublayer site (the mHC coefficients with and without the stream update, the norm and cast, the
  FP8 linear of float inputs, the MoE route, the Engram gate) gives B rows the bits alone that it gives them among
  (1 + w)·B rows.

Batch invariance is process-wide and must precede the first GEMM, so each case runs this file as a script in a
fresh process (`python tests/model/test_gpu_invariance.py CASE B [--variant]`); on a mismatch the script names the
modules whose outputs first differ between the plain step and the verify pass (eager forwards, forward hooks).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "model" / "checkpoints" / "v41-demo"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(case: str, batch: int) -> None:
    done = subprocess.run(
        [sys.executable, __file__, case, str(batch)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.parametrize("batch", [1, 24])
def test_verify_logits_equal_the_plain_steps_bit_for_bit(batch: int) -> None:
    _run("logits", batch)


@pytest.mark.parametrize("batch", [1, 24])
def test_greedy_dspark_emits_plain_greedy_tokens(batch: int) -> None:
    _run("tokens", batch)


@pytest.mark.parametrize("batch", [1, 24])
def test_site_kernels_give_a_row_its_bits_in_any_batch(batch: int) -> None:
    _run("kernels", batch)


# ------------------------------------------------------------------------------------------- the script


def _prompts(model, count: int, seed: int):
    from model import encode_prefill

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 90, (count,), generator=g).tolist()
    return [encode_prefill(model, torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist()) for n in lengths]


def _joined(model, prompts, graphs: bool):
    """A batch of the prompts and each row's first token, in the batch's row order (by replay length, not the
    prompts')."""
    from model import DecodeBatch

    batch = DecodeBatch(model, len(prompts), graphs=graphs)
    first = dict(batch.join_many([(p.blocks, p.encoder_state) for p in prompts]))
    return batch, [int(first[seq].argmax()) for seq in batch.seq_ids]


def _plain_greedy(model, prompts, steps: int, graphs: bool) -> tuple[list[list[int]], list[Tensor]]:
    """Per row the tokens of `steps` plain greedy steps (the first from the prompt), and each step's logits."""
    batch, pending = _joined(model, prompts, graphs)
    tokens, logits = [[t] for t in pending], []
    for _ in range(steps):
        logits.append(batch.decode_step([row[-1] for row in tokens]).float())
        for row, t in zip(tokens, logits[-1].argmax(-1).tolist(), strict=True):
            row.append(t)
    return tokens, logits


# The kernels whose results the diagnosis records beside the modules' outputs: those called outside a module's
# __call__ (an attention's projections, a block's stream update and norms), whose outputs no hook sees.
PROBED = (
    "indexer_scores", "topk_indices", "sparse_attention", "fp8_linear", "fp8_linear_cast", "norm_cast",
    "hc_coefficients", "hc_expand_coefficients", "moe_route",
)  # fmt: skip


def _recorded(model: nn.Module):
    """Forward hooks and kernel probes recording each module's and kernel's outputs (each tensor of a tuple, the
    i-th named `name[i]`), in call order."""
    from model import kernels

    seen: list[tuple[str, Tensor]] = []

    def keep(name: str, output) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        for i, out in enumerate(outputs):
            if isinstance(out, Tensor):
                seen.append((f"{name}[{i}]" if i else name, out.detach().clone()))

    def probe(name: str):
        op = getattr(kernels, name)

        def run(*args, **kwargs):
            out = op(*args, **kwargs)
            keep(f"kernels.{name}", out)
            return out

        return op, run

    handles = [m.register_forward_hook(lambda _m, _i, o, n=n: keep(n, o)) for n, m in model.named_modules() if n]
    probes = {n: probe(n) for n in PROBED}
    for name, (_, run) in probes.items():
        setattr(kernels, name, run)

    def remove() -> None:
        for h in handles:
            h.remove()
        for name, (op, _) in probes.items():
            setattr(kernels, name, op)

    return seen, remove


def _at(out: Tensor, B: int, T: int, j: int) -> Tensor | None:
    """Position j of each sequence in an output of B × T rows ([B, T, ...] or [B·T, ...])."""
    if out.dim() >= 2 and out.shape[:2] == (B, T):
        return out[:, j]
    if out.shape[0] == B * T:
        return out.view(B, T, *out.shape[1:])[:, j]
    return None


def _diverging(model, prompts, tokens: list[list[int]], width: int) -> list[str]:
    """Eager plain steps and one verify pass from the same state, recorded: the calls whose outputs at a position
    differ from that position's plain step (the first ones, by position)."""
    from model.dspark import Draft
    from model.sampling import SamplingParams

    B, T = len(prompts), 1 + width
    plain = []
    batch, _ = _joined(model, prompts, graphs=False)
    for j in range(T):
        seen, remove = _recorded(model)
        batch.decode_step([row[j] for row in tokens])
        remove()
        plain.append(seen)
    batch, _ = _joined(model, prompts, graphs=False)
    seen, remove = _recorded(model)
    drafts = torch.tensor([row[1:T] for row in tokens], device="cuda")
    probs = nn.functional.one_hot(drafts, model.args.vocab_size).float()
    batch.verify([row[0] for row in tokens], Draft(drafts, probs, torch.ones(B, width, device="cuda")),
                 SamplingParams.uniform(B))  # fmt: skip
    remove()
    found = []
    for j in range(T):
        at_j = []
        for (name, p), (other, v) in zip(plain[j], seen, strict=False):
            if name != other:
                at_j.append(f"position {j}: calls part at {name} / {other}")
                break
            p, v = _at(p, B, 1, 0), _at(v, B, T, j)
            if p is None or v is None:
                continue
            v = v[..., : p.shape[-1]] if p.dim() == v.dim() else v  # scores over more entries: the plain step's
            if p.shape == v.shape and not torch.equal(p, v):
                at_j.append(f"position {j} {name}: {_difference(p, v)}")
        found += at_j[:5]
    return found


def check_logits(batch: int, graphs: bool) -> list[str]:
    from model import build_model, preset
    from model.dspark import Draft
    from model.sampling import SamplingParams

    model = build_model(preset("small"), seed=0, device="cuda", dtype=torch.bfloat16)
    prompts = _prompts(model, batch, seed=batch)
    width = model.args.dspark_block_size
    tokens, logits = _plain_greedy(model, prompts, width + 1, graphs)
    spec, _ = _joined(model, prompts, graphs)
    drafts = torch.tensor([row[1 : width + 1] for row in tokens], device="cuda")
    probs = nn.functional.one_hot(drafts, model.args.vocab_size).float()
    result = spec.verify([row[0] for row in tokens], Draft(drafts, probs, torch.ones(batch, width, device="cuda")),
                         SamplingParams.uniform(batch))  # fmt: skip
    errors = [
        f"graphs={graphs} position {j}: max |Δ| {float((result.logits[:, j] - logits[j]).abs().max()):.3g}"
        for j in range(width + 1)
        if not torch.equal(result.logits[:, j].float(), logits[j])
    ]
    if errors:
        errors += _diverging(model, prompts, tokens, width)[:30]
    return errors


def _site_ops(batch: int, g: torch.Generator) -> dict[str, tuple]:
    """Name → (the op, its inputs of `batch` rows) for each site kernel at the `small` preset's sizes, random inputs
    and weights (the weights shared by every call)."""
    from model import kernels, preset
    from model.engram import gated_add

    args = preset("small")
    n, C, E = args.hc_mult, args.hidden_size, args.n_routed_experts

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return torch.randn(shape, generator=g, device="cuda").to(dtype)

    M = (2 + n) * n
    mix = (rand(M, n * C, dtype=torch.float32) * 0.05, rand(3, dtype=torch.float32), rand(M, dtype=torch.float32))
    sinkhorn = (n, args.hc_sinkhorn_iters, args.rms_norm_eps, args.hc_eps)
    norm, gate, bias = rand(C), rand(E, C, dtype=torch.float32) * 0.05, rand(E, dtype=torch.float32)
    w = (torch.randn((3 * C, C), generator=g, device="cuda") * 64).to(torch.float8_e4m3fn)
    w_scale = torch.full((3 * C // 32, C // 32), 120, dtype=torch.uint8, device="cuda")  # 2^-7
    post, comb = rand(batch, n, dtype=torch.float32).sigmoid(), rand(batch, n, n, dtype=torch.float32).softmax(-1)
    route = (args.num_experts_per_tok, args.norm_topk_prob, args.routed_scaling_factor)

    def coefficients(X: Tensor) -> tuple[Tensor, ...]:
        return kernels.hc_coefficients(X, *mix, *sinkhorn, backend="triton")

    def expand(out: Tensor, X: Tensor, post: Tensor, comb: Tensor) -> tuple[Tensor, ...]:
        return kernels.hc_expand_coefficients(out, X, post, comb, *mix, *sinkhorn, backend="triton")

    def engram(X: Tensor, kv: Tensor) -> Tensor:
        ones = X.new_ones(n, C)
        return gated_add(X.unsqueeze(1), kv.unsqueeze(1), ones, ones, args.rms_norm_eps)

    return {
        "hc_coefficients": (coefficients, rand(batch, n, C)),
        "hc_expand_coefficients": (expand, rand(batch, C), rand(batch, n, C), post, comb),
        "norm_cast": (lambda X, pre: kernels.norm_cast(X, pre, norm, args.rms_norm_eps, backend="triton"),
                      rand(batch, n, C), post),
        "fp8_linear_cast": (lambda x: kernels.fp8_linear_cast(x, w, w_scale, backend="triton"), rand(batch, C)),
        "moe_route": (lambda x: kernels.moe_route(x, gate, bias, *route, backend="triton"), rand(batch, C)),
        "engram gated_add": (engram, rand(batch, n, C), rand(batch, (n + 1) * C)),
    }  # fmt: skip


def check_kernels(batch: int) -> list[str]:
    """Each site kernel (`_site_ops`) on `batch` random rows, alone and as the rows at position j of (1 + w)·batch
    rows (the others random): every output's rows bit for bit."""
    from model import preset

    T = 1 + preset("small").dspark_block_size
    g = torch.Generator(device="cuda").manual_seed(batch)

    def among(rows: Tensor, j: int) -> Tensor:
        wide = torch.randn((batch, T, *rows.shape[1:]), generator=g, device="cuda").to(rows.dtype)
        wide[:, j] = rows
        return wide.flatten(0, 1)

    def outputs(out: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return out if isinstance(out, tuple) else (out,)

    errors = []
    for name, (op, *rows) in _site_ops(batch, g).items():
        alone = outputs(op(*rows))
        for j in (0, T - 1):
            among_others = outputs(op(*(among(r, j) for r in rows)))
            for i, (a, b) in enumerate(zip(alone, among_others, strict=True)):
                b = b.view(batch, T, *b.shape[1:])[:, j].reshape(a.shape)
                if not torch.equal(a, b):
                    errors.append(f"{name} output {i} at position {j}: {_difference(a, b)}")
    return errors


def _difference(a: Tensor, b: Tensor) -> str:
    """How two tensors of one shape differ: the largest |Δ| (NaNs left out) and how many elements."""
    diff = (a.double() - b.double()).abs().nan_to_num(0.0, 0.0, 0.0)
    return f"max |Δ| {float(diff.max()):.3g}, {int((a != b).sum())} differ"


def check_tokens(batch: int) -> list[str]:
    from model.sampling import SamplingParams
    from model_service.runtime import load_model

    model = load_model(str(DEMO), "full", device="cuda")
    prompts = _prompts(model, batch, seed=100 + batch)
    steps = 40
    plain, _ = _plain_greedy(model, prompts, steps, graphs=True)
    spec, pending = _joined(model, prompts, graphs=True)
    greedy = SamplingParams.uniform(batch)
    emitted = [[t] for t in pending]
    while min(len(row) for row in emitted) <= steps:
        draft = spec.dspark_draft([row[-1] for row in emitted], greedy)
        for row, more in zip(emitted, spec.verify([row[-1] for row in emitted], draft, greedy).tokens, strict=True):
            row += more
    return [
        f"row {b}: plain {p[: steps + 1]} speculative {s[: steps + 1]}"
        for b, (p, s) in enumerate(zip(plain, emitted, strict=True))
        if p[: steps + 1] != s[: steps + 1]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=["logits", "tokens", "kernels"])
    parser.add_argument("batch", type=int)
    parser.add_argument("--variant", action="store_true", help="without batch invariance (to see what it fixes)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from model import kernels

    kernels.set_batch_invariant(not args.variant)
    with torch.no_grad():
        if args.case == "logits":
            errors = [e for graphs in (False, True) for e in check_logits(args.batch, graphs)]
        elif args.case == "kernels":
            errors = check_kernels(args.batch)
        else:
            errors = check_tokens(args.batch)
    print("\n".join(errors) or f"{args.case} B={args.batch}: equal")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
