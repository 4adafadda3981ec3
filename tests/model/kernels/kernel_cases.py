"""Random inputs for the kernel tests (tiny shapes: interpreted Triton is slow). Shared by the reference tests and the
Triton-vs-reference tests; bench/kernels.py --check builds the same kind of inputs at real sizes."""

import torch
from torch import Tensor

from model import quant


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def indexer_case(g: torch.Generator, B: int, T: int, H: int, Di: int, S: int) -> tuple[Tensor, ...]:
    q_data, q_scale = quant.fp4_quant_ue8m0(torch.randn(B, T, H, Di, generator=g))
    k_data, k_scale = quant.fp4_quant_ue8m0(torch.randn(B, S, Di, generator=g) * 0.3)
    weights = torch.randn(B, T, H, generator=g)
    n_visible = torch.randint(0, S + 1, (B, T), generator=g)
    n_visible[0, -1] = S  # one full row and one empty row among the ragged ones
    n_visible[-1, 0] = 0
    return q_data, q_scale, weights, k_data, k_scale, n_visible


def assert_indexer_scores_close(got: Tensor, want: Tensor, case: tuple[Tensor, ...]) -> None:
    """Triton indexer scores against the reference: the same −inf mask, and per position within 2^-20 of
    Σ_h |w|·|q·K|, which bounds the magnitude of every partial sum (fp32 reorders of exact products err well under)."""
    assert got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    q = quant.fp4_dequant_ue8m0(*case[:2])
    k = quant.fp4_dequant_ue8m0(*case[3:5])
    bound = torch.einsum("bth,bths->bts", case[2].abs(), torch.einsum("bthd,bsd->bths", q, k).abs()) * 2.0**-20
    finite = torch.isfinite(want)
    assert ((got - want).abs()[finite] <= bound[finite] + 1e-30).all()


def candidate_case(g: torch.Generator, S: int, tied: bool = False) -> tuple[Tensor, Tensor]:
    """Scores [2, 3, S] (`tied`: values in {−1, 0, 1}, so block maxima tie) and ragged n_visible with one empty and
    one full row."""
    scores = torch.randint(-1, 2, (2, 3, S), generator=g).float() if tied else torch.randn(2, 3, S, generator=g)
    n_visible = torch.randint(0, S + 1, (2, 3), generator=g)
    n_visible[0, 0], n_visible[1, 2] = 0, S
    return scores, n_visible


def attention_case(
    g: torch.Generator, B: int, T: int, H: int, D: int, W: int, N: int, K: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float]:
    q = torch.randn(B, T, H, D, generator=g)
    swa_data, swa_scale = quant.fp8_quant(torch.randn(B, W, D, generator=g))
    kv_data, kv_scale = quant.fp4_quant_e4m3(torch.randn(B, N, D, generator=g))
    slots = torch.stack([torch.randperm(W, generator=g) for _ in range(B * T)]).view(B, T, W)
    swa_idx = torch.where(torch.rand(B, T, W, generator=g) < 0.7, slots, -1).int()  # any order, −1 gaps
    swa_idx[0, 0] = -1  # a query with no window key
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(B * T)]).view(B, T, K).int()
    n_selected = torch.randint(0, K + 1, (B, T, 1), generator=g)
    idx = torch.where(torch.arange(K) < n_selected, idx, -1)  # ragged, −1 padded tails
    idx[0, 0] = -1  # ... and that query sees nothing but the sink
    sink = torch.randn(H, generator=g)
    R = W // 2  # slots < R: the ring's, the rest: the step's new keys
    ring, new = (swa_data[:, :R], swa_scale[:, :R]), (swa_data[:, R:], swa_scale[:, R:])
    return q, *ring, *new, swa_idx, kv_data, kv_scale, idx, sink, D**-0.5


def topk_case(g: torch.Generator, R: int, L: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    scores = torch.randn(R, L, generator=g).to(dtype)
    scores[torch.rand(R, L, generator=g) < 0.1] = float("-inf")
    lengths = torch.randint(0, L + 1, (R,), generator=g)
    lengths[0] = L
    return scores, lengths


def tied_topk_case(g: torch.Generator, R: int, L: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Few distinct values, so ties are everywhere (as ReLU's exact zeros make them); ±0, −inf and NaN among them."""
    values = torch.tensor([-1.0, 0.0, -0.0, 0.0, 1.0, 2.0, float("-inf"), float("nan")])
    scores = values[torch.randint(0, len(values), (R, L), generator=g)].to(dtype)
    lengths = torch.randint(0, L + 1, (R,), generator=g)
    lengths[0] = L
    return scores, lengths


def lowest_position_topk(scores: Tensor, k: int, lengths: Tensor | None) -> Tensor:
    """The definition: rank the selectable positions by (score descending, position ascending), keep k, sort them."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for r, row in enumerate(scores.float().tolist()):
        n = len(row) if lengths is None else int(lengths[r])
        ranked = sorted((p for p in range(n) if row[p] > float("-inf")), key=lambda p: (-row[p], p))
        chosen = sorted(ranked[:k])
        out[r, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def fp8_linear_case(g: torch.Generator, M: int, N: int, K: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FP8 activations [M, K] (the QAT cast of Gaussian rows) and an FP8 weight [N, K]: every E4M3 byte but NaN, one
    UE8M0 scale per 32 × 32 block around 2^-4 (float8_e4m3fn, as checkpoints store it)."""
    x_data, x_scale = quant.fp8_quant(torch.randn(M, K, generator=g))
    w = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    w = torch.where((w & 0x7F) == 0x7F, 0x7E, w)
    w_scale = torch.randint(118, 128, (-(-N // 32), K // 32), generator=g, dtype=torch.uint8)
    return x_data, x_scale, w.view(torch.float8_e4m3fn), w_scale


def plain_fp8_operands(
    x_data: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Both FP8 operands dequantised by model.quant (the weight's block scales repeated over its 32 rows), in dtype."""
    rows = w_scale.repeat_interleave(32, dim=0)[: w.shape[0]]
    return quant.fp8_dequant(x_data, x_scale, dtype=dtype), quant.fp8_dequant(w.view(torch.uint8), rows, dtype=dtype)


def moe_case(
    g: torch.Generator, N: int, k: int, E: int, C: int, I: int, block: int, ids: Tensor | None = None
) -> tuple[Tensor, ...]:
    """FP8 activations [N, C]; expert ids [N, k] (k distinct random experts per token, unless given) and routing
    weights; packed E2M1 experts w13 [E, 2I, C/2], w2 [E, C, I/2] quantised from Gaussian weights with UE8M0 scales
    per `block` inputs."""
    x_data, x_scale = quant.fp8_quant(torch.randn(N, C, generator=g))
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g)
    w13, s13 = quant.fp4_quant_ue8m0(torch.randn(E, 2 * I, C, generator=g) * 0.1, block)
    w2, s2 = quant.fp4_quant_ue8m0(torch.randn(E, C, I, generator=g) * 0.1, block)
    return x_data, x_scale, ids, weights, w13, s13, w2, s2
