"""Hot operations of the V4.1 inference path, each a torch reference beside a Triton kernel.

Every op takes `backend="torch" | "triton"`; `default_backend()` picks Triton when CUDA is present. Shapes:
B sequences, T queries per sequence (1 for decode, 1 + drafts for verification, a tile for prefill), H heads,
D latent dim, W ring slots, N compressed entries stored, S scored positions, K top-k. See docs/kernels.md.

Without a GPU, Triton can only run its interpreter, so TRITON_INTERPRET is set before any kernel is defined
(Triton reads it when a kernel is decorated): the Triton backend then works on CPU tensors, slowly.
"""

import os
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model.kernels import (
    act_cast,
    candidates,
    fp8_gemm,
    hc_mixes,
    indexer,
    kv_quant,
    moe_gemm,
    rope,
    route,
    row_gather,
    sparse_attn,
    topk,
)
from model.kernels.fp8_gemm import FP8GemmTuning
from model.kernels.invariance import batch_invariant, set_batch_invariant
from model.kernels.moe_gemm import MoEGemmTuning

Backend = Literal["torch", "triton"]

__all__ = [
    "Backend",
    "FP8GemmTuning",
    "MoEGemmTuning",
    "backend_for",
    "batch_invariant",
    "candidate_mask",
    "casts_in_gemm",
    "default_backend",
    "dequantize_index_fp4",
    "dequantize_kv_fp4",
    "dequantize_swa_fp8",
    "fake_quant_fp8",
    "fp8_linear",
    "fp8_linear_cast",
    "gather_rows",
    "hc_coefficients",
    "hc_expand_coefficients",
    "indexer_scores",
    "moe_down",
    "moe_gate_up",
    "moe_gate_up_cast",
    "moe_pairs",
    "moe_route",
    "norm_cast",
    "quantize_index_fp4",
    "quantize_kv_fp4",
    "quantize_swa_fp8",
    "rope_rotate",
    "set_batch_invariant",
    "sparse_attention",
    "swiglu_cast",
    "topk_indices",
]


def default_backend() -> Backend:
    return "triton" if torch.cuda.is_available() else "torch"


def backend_for(t: Tensor) -> Backend:
    """The backend for tensors on t's device: Triton on a GPU, the torch reference elsewhere."""
    return default_backend() if t.is_cuda else "torch"


def _carries_grad(*tensors: Tensor) -> bool:
    """Whether autograd would record an op on these tensors (the Triton kernels without a backward then step aside)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _pick(backend: Backend, module: object, op: str):
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    return getattr(module, f"{op}_{backend}")


def _expect(name: str, t: Tensor, shape: Sequence[int | None], dtypes: Sequence[torch.dtype] | None = None) -> None:
    """Check rank, the sizes given (None = any) and the dtype of an argument, naming it in the error."""
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {wanted}, got {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")


_INTS = (torch.int32, torch.int64)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_WIDE_FLOATS = (*_FLOATS, torch.float64)  # attention also takes a float64 model's queries (the exactness tests)


# ------------------------------------------------------------------------------------------- KV formats


def quantize_kv_fp4(x: Tensor, backend: Backend = "torch") -> tuple[Tensor, Tensor]:
    """Main KV: [..., D] → (packed E2M1 uint8 [..., D/2], E4M3 scale bits uint8 [..., D/16])."""
    return _pick(backend, kv_quant, "quantize_kv_fp4")(x)


def quantize_index_fp4(x: Tensor, backend: Backend = "torch") -> tuple[Tensor, Tensor]:
    """Indexer q/K: [..., D] → (packed E2M1 uint8 [..., D/2], UE8M0 scales uint8 [..., D/32])."""
    return _pick(backend, kv_quant, "quantize_index_fp4")(x)


def quantize_swa_fp8(
    x: Tensor,
    backend: Backend = "torch",
    rope: tuple[Tensor, Tensor] | None = None,
    norm: tuple[Tensor, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """SWA ring: [..., D] → (E4M3 bits uint8 [..., D], UE8M0 scales uint8 [..., D/32]); with `rope` = (positions
    over x's leading dims, inv_freq), of x after RoPE on its last 2·len(inv_freq) dims (a power of two), applied in
    the same launch as `rope_rotate` applies it; with `norm` = (weight [D], eps), of RMSNorm(x) (`model.norm.rms_norm`,
    rounded to x's dtype) first, in that launch too."""
    if rope is not None:
        _check_rope(rope, x.shape[:-1], x.shape[-1])
    if norm is not None:
        _expect("norm weight", norm[0], (x.shape[-1],), _WIDE_FLOATS)
    return _pick(backend, kv_quant, "quantize_swa_fp8")(x, rope, norm)


def _check_rope(rope: tuple[Tensor, Tensor], lead: Sequence[int], D: int) -> None:
    """A kernel's `rope` = (integer positions over the leading dims `lead`, inv_freq of a power-of-two count of
    rotary dims within D): ValueError naming what is wrong."""
    positions, inv_freq = rope
    _expect("rope inv_freq", inv_freq, (None,))
    fits = positions.dim() == len(lead) and all(p in (1, n) for p, n in zip(positions.shape, lead, strict=True))
    if positions.dtype not in _INTS or not fits:
        raise ValueError(
            f"rope positions: expected integers over {list(lead)}, got {positions.dtype} {list(positions.shape)}"
        )
    rd = 2 * inv_freq.shape[0]
    if rd == 0 or rd > D or rd & (rd - 1):
        raise ValueError(f"rope inv_freq: {rd} rotary dims are not a power of two within the last dim {D}")


def dequantize_kv_fp4(data: Tensor, scale: Tensor, dtype: torch.dtype, backend: Backend = "torch") -> Tensor:
    return _pick(backend, kv_quant, "dequantize_kv_fp4")(data, scale, dtype)


def dequantize_index_fp4(data: Tensor, scale: Tensor, dtype: torch.dtype, backend: Backend = "torch") -> Tensor:
    return _pick(backend, kv_quant, "dequantize_index_fp4")(data, scale, dtype)


def dequantize_swa_fp8(data: Tensor, scale: Tensor, dtype: torch.dtype, backend: Backend = "torch") -> Tensor:
    return _pick(backend, kv_quant, "dequantize_swa_fp8")(data, scale, dtype)


def fake_quant_fp8(x: Tensor, backend: Backend = "torch") -> Tensor:
    """QAT FP8 cast (E4M3, UE8M0 per 32) of quantised linears' inputs and of the SWA ring's values:
    `quant.fake_quant_fp8` (value and straight-through gradient), in one launch on the Triton side."""
    _expect("x", x, (None,) * x.dim(), _WIDE_FLOATS)
    if x.dtype == torch.float64:  # the kernel computes in fp32
        backend = "torch"
    return _pick(backend, kv_quant, "fake_quant_fp8")(x)


# ------------------------------------------------------------------------------------------- mHC


def hc_coefficients(
    X: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    n: int,
    iters: int,
    rms_eps: float,
    hc_eps: float,
    backend: Backend = "torch",
) -> tuple[Tensor, Tensor, Tensor]:
    """A sublayer site's mHC coefficients from its stream X [..., n, C] and projection fn [(2+n)n, nC] → pre [..., n],
    post [..., n], comb [..., n, n] (`model.mhc.hc_mixes` then `model.mhc.hc_split_sinkhorn`). The Triton kernels
    have no backward and compute in fp32: a gradient to carry or fp64 keep the torch form."""
    if _coefficients_backend(X, fn, scale, base, n, iters) == "torch":
        backend = "torch"
    return _pick(backend, hc_mixes, "hc_coefficients")(X, fn, scale, base, n, iters, rms_eps, hc_eps)


def hc_expand_coefficients(
    out: Tensor,
    X: Tensor,
    post: Tensor,
    comb: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    n: int,
    iters: int,
    rms_eps: float,
    hc_eps: float,
    backend: Backend = "torch",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The residual update of a site and the next site's coefficients in one pass: X' = `model.mhc.hc_expand`(out
    [..., C], X [..., n, C], post [..., n], comb [..., n, n]) → (X', `hc_coefficients`(X', …)). The Triton side makes
    X' inside the coefficients' projection (two launches in all, not three); the rules of `hc_coefficients` apply."""
    _expect("out", out, (*X.shape[:-2], X.shape[-1]), (X.dtype,))
    _expect("post", post, X.shape[:-1])
    _expect("comb", comb, (*X.shape[:-1], n))
    if _coefficients_backend(X, fn, scale, base, n, iters) == "torch" or _carries_grad(out, post, comb):
        backend = "torch"
    return _pick(backend, hc_mixes, "hc_expand_coefficients")(
        out, X, post, comb, fn, scale, base, n, iters, rms_eps, hc_eps
    )


def _coefficients_backend(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int, iters: int) -> Backend | None:
    """Check the coefficients' arguments; "torch" where the kernels do not apply (a gradient to carry, a non-fp32
    projection, an fp64 stream), else None (the caller's choice)."""
    _expect("X", X, (*X.shape[:-2], n, X.shape[-1]), _WIDE_FLOATS)
    _expect("fn", fn, ((2 + n) * n, n * X.shape[-1]), _WIDE_FLOATS)
    _expect("scale", scale, (3,))
    _expect("base", base, ((2 + n) * n,))
    if n & (n - 1) or iters < 1:
        raise ValueError(f"n must be a power of two and iters ≥ 1, got n={n}, iters={iters}")
    if _carries_grad(X, fn, scale, base) or fn.dtype != torch.float32 or X.dtype == torch.float64:
        return "torch"
    return None


def norm_cast(
    X: Tensor, pre: Tensor | None, weight: Tensor, eps: float, backend: Backend = "torch"
) -> tuple[Tensor, Tensor, Tensor]:
    """A sublayer site's input and its FP8 cast: x = RMSNorm(collapse(X, pre)) with `weight` — X [..., n, C], pre
    [..., n] —, or RMSNorm(X) of X [..., C] without pre → (x in X's dtype, E4M3 bits uint8 [..., C], UE8M0 scales
    uint8 [..., C/32]: `quantize_swa_fp8(x)`), one launch on the Triton side. fp64 or a gradient to carry keep the
    torch form."""
    lead = X.shape[:-1] if pre is None else X.shape[:-2]
    if pre is not None:
        _expect("X", X, (*lead, None, None), _WIDE_FLOATS)
        _expect("pre", pre, X.shape[:-1], _WIDE_FLOATS)
    _expect("X", X, (*X.shape[:-1], None), _WIDE_FLOATS)
    C = X.shape[-1]
    _expect("weight", weight, (C,), _WIDE_FLOATS)
    if C % kv_quant.SWA_BLOCK:
        raise ValueError(f"X: channels must be a multiple of {kv_quant.SWA_BLOCK}, got {C}")
    if X.dtype == torch.float64 or _carries_grad(X, weight, *(() if pre is None else (pre,))):
        backend = "torch"
    return _pick(backend, act_cast, "norm_cast")(X, pre, weight, eps)


def swiglu_cast(gate: Tensor, up: Tensor, limit: float, backend: Backend = "torch") -> tuple[Tensor, Tensor]:
    """The shared expert's hidden h = silu(min(gate, limit)) · clamp(up, ±limit) of gate, up [M, I] (column views of
    one GEMM output are read in place) as W2 reads it: E4M3 bits uint8 [M, I] and UE8M0 scales uint8 [M, I/32] of h
    in gate's dtype, one launch on the Triton side. fp64 or a gradient to carry keep the torch form."""
    _expect("gate", gate, (None, None), _WIDE_FLOATS)
    _expect("up", up, gate.shape, (gate.dtype,))
    if gate.shape[1] % kv_quant.SWA_BLOCK:
        raise ValueError(f"gate: width must be a multiple of {kv_quant.SWA_BLOCK}, got {gate.shape[1]}")
    if gate.dtype == torch.float64 or _carries_grad(gate, up):
        backend = "torch"
    return _pick(backend, act_cast, "swiglu_cast")(gate, up, limit)


# ------------------------------------------------------------------------------------------- RoPE


def rope_rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool, backend: Backend = "torch") -> Tensor:
    """Rotate x's last 2·len(inv_freq) dims (adjacent pairs) by positions × inv_freq (`inverse`: by −that);
    positions [S] or [B, S] index x's position axis, later axes (heads) broadcast. The Triton kernel computes in
    fp32 and has no backward: fp64 x, a gradient to carry or a rotary width that is not a power of two keep the torch
    form."""
    _expect("inv_freq", inv_freq, (None,))
    rd = inv_freq.shape[0] * 2
    if x.dim() < 1 or x.shape[-1] < rd or (x.shape[-1] - rd) % 2:
        raise ValueError(f"x: last dim must hold the {rd} rotary dims at an even offset, got shape {list(x.shape)}")
    lead = x.shape[: positions.dim()]
    if positions.dim() > x.dim() - 1 or any(p not in (1, n) for p, n in zip(positions.shape, lead, strict=True)):
        raise ValueError(f"positions: expected x's leading dims {list(x.shape[:-1])}, got {list(positions.shape)}")
    if _carries_grad(x) or x.dtype not in _FLOATS or rd & (rd - 1):
        backend = "torch"
    return _pick(backend, rope, "rope_rotate")(x, positions, inv_freq, inverse)


# ------------------------------------------------------------------------------------------- indexer


def indexer_scores(
    q_data: Tensor,
    q_scale: Tensor,
    weights: Tensor,
    k_data: Tensor,
    k_scale: Tensor,
    n_visible: Tensor,
    backend: Backend = "torch",
) -> Tensor:
    """I[b,t,s] = Σ_h w·ReLU(q·K) from FP4 q [B,T,H,Di/2] and K [B,S,Di/2] (UE8M0 / 32); −inf for s ≥ n_visible."""
    _expect("q_data", q_data, (None, None, None, None), (torch.uint8,))
    B, T, H, half = q_data.shape
    if 2 * half % kv_quant.INDEX_BLOCK != 0:
        raise ValueError(f"q_data: index dim must be a multiple of {kv_quant.INDEX_BLOCK}, got {2 * half}")
    _expect("q_scale", q_scale, (B, T, H, 2 * half // kv_quant.INDEX_BLOCK), (torch.uint8,))
    _expect("weights", weights, (B, T, H), _FLOATS)
    _expect("k_data", k_data, (B, None, half), (torch.uint8,))
    _expect("k_scale", k_scale, (B, k_data.shape[1], 2 * half // kv_quant.INDEX_BLOCK), (torch.uint8,))
    _expect("n_visible", n_visible, (B, T), _INTS)
    return _pick(backend, indexer, "indexer_scores")(q_data, q_scale, weights, k_data, k_scale, n_visible)


def candidate_mask(
    scores: Tensor, n_visible: Tensor, block_size: int, topk_blocks: int, backend: Backend = "torch"
) -> Tensor:
    """Level-1 pool: top `topk_blocks` blocks of `block_size` positions (newest pinned) → bool [B, T, S]."""
    _expect("scores", scores, (None, None, None), _FLOATS)
    _expect("n_visible", n_visible, scores.shape[:2], _INTS)
    if block_size < 1 or topk_blocks < 1:
        raise ValueError(f"block_size and topk_blocks must be ≥ 1, got {block_size} and {topk_blocks}")
    return _pick(backend, candidates, "candidate_mask")(scores, n_visible, block_size, topk_blocks)


def topk_indices(scores: Tensor, k: int, lengths: Tensor | None = None, backend: Backend = "torch") -> Tensor:
    """Top-min(k, length) positions of each row [R, L] among its first lengths[r] (−inf/NaN never chosen),
    sorted ascending by position, −1 padded → int32 [R, k]."""
    _expect("scores", scores, (None, None), _FLOATS)
    if lengths is not None:
        _expect("lengths", lengths, (scores.shape[0],), _INTS)
    if k < 0:
        raise ValueError(f"k must be ≥ 0, got {k}")
    return _pick(backend, topk, "topk_indices")(scores, k, lengths)


def gather_rows(table: Tensor, ids: Tensor, out: Tensor, backend: Backend = "torch") -> None:
    """out[i] = table[ids[i]], bit for bit: table [N, ...] (any dtype), ids int [M], out [M, ...] of the table's
    dtype and row shape, both contiguous. The Triton kernel reads the table where it lies — on the GPU, or in
    page-locked host memory, which unified addressing maps into the GPU's (`row_gather`) — with ids and out on the
    GPU; the torch reference indexes the table on its own device."""
    _expect("ids", ids, (None,), _INTS)
    _expect("out", out, (ids.shape[0], *table.shape[1:]), (table.dtype,))
    if not (table.is_contiguous() and out.is_contiguous()):
        raise ValueError("gather_rows: table and out must be contiguous")
    _pick(backend, row_gather, "gather_rows")(table, ids, out)


# ------------------------------------------------------------------------------------------- attention


def sparse_attention(
    q: Tensor,
    swa_data: Tensor,
    swa_scale: Tensor,
    new_data: Tensor,
    new_scale: Tensor,
    swa_idx: Tensor,
    kv_data: Tensor,
    kv_scale: Tensor,
    idx: Tensor,
    sink: Tensor,
    softmax_scale: float,
    backend: Backend = "torch",
    rope: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Attention of q [B,T,H,D] over [its window: FP8 key slots swa_idx [B,T,W] of [ring swa_data [B,R,D] ‖ new keys
    new_data [B,N',D]] (their UE8M0 scales per 32 beside them), oldest position first ‖ FP4 entries idx] (−1 = none)
    with a sink → q's dtype. With `rope` = (positions [B, T], inv_freq), q is before RoPE and the output after
    RoPE⁻¹ on their last 2·len(inv_freq) dims (a power of two), applied in the same launch as `rope_rotate` applies
    them; without it q is rotated and the output is not.

    The torch reference computes in q's precision (at least fp32), the Triton kernel in fp32. N may be 0 (nothing
    stored yet): then every idx slot must be −1."""
    _expect("q", q, (None, None, None, None), _WIDE_FLOATS)
    B, T, H, D = q.shape
    if D % kv_quant.SWA_BLOCK != 0:
        raise ValueError(f"q: latent dim must be a multiple of {kv_quant.SWA_BLOCK}, got {D}")
    for name, data, scale in (("swa", swa_data, swa_scale), ("new", new_data, new_scale)):
        _expect(f"{name}_data", data, (B, None, D), (torch.uint8,))
        _expect(f"{name}_scale", scale, (B, data.shape[1], D // kv_quant.SWA_BLOCK), (torch.uint8,))
    _expect("swa_idx", swa_idx, (B, T, None), _INTS)
    _expect("kv_data", kv_data, (B, None, D // 2), (torch.uint8,))
    _expect("kv_scale", kv_scale, (B, kv_data.shape[1], D // kv_quant.KV_BLOCK), (torch.uint8,))
    _expect("idx", idx, (B, T, None), _INTS)
    _expect("sink", sink, (H,), _WIDE_FLOATS)
    if rope is not None:
        _check_rope(rope, (B, T), D)
    return _pick(backend, sparse_attn, "sparse_attention")(
        q, swa_data, swa_scale, new_data, new_scale, swa_idx, kv_data, kv_scale, idx, sink, softmax_scale, rope
    )


# ------------------------------------------------------------------------------------------- quantised GEMMs


def _tuned(backend: Backend, module: object, op: str, tuning: object | None, *args: object) -> Tensor:
    """`_pick`'s op on args; the Triton form with the launch shape `tuning` when one is given."""
    fn = _pick(backend, module, op)
    return fn(*args) if tuning is None or backend == "torch" else fn(*args, tuning=tuning)


def _gemm_backend(out_dtype: torch.dtype, backend: Backend) -> Backend:
    """Check a quantised GEMM's out_dtype; fp64 (an fp64 model) keeps the reference, the kernels compute in fp32."""
    if out_dtype not in _WIDE_FLOATS:
        raise ValueError(f"out_dtype: expected {' or '.join(map(str, _WIDE_FLOATS))}, got {out_dtype}")
    return "torch" if out_dtype == torch.float64 else backend


def _expect_fp8_rows(name: str, data: Tensor, rows: int | None = None) -> tuple[int, int]:
    """FP8 activations: E4M3 bytes [rows, K], K a multiple of 32 (its UE8M0 scales are checked by the caller)."""
    _expect(name, data, (rows, None), (torch.uint8,))
    if data.shape[1] % kv_quant.SWA_BLOCK:
        raise ValueError(f"{name}: inputs must be a multiple of {kv_quant.SWA_BLOCK}, got {data.shape[1]}")
    return data.shape[0], data.shape[1]


def _expect_fp8_weight(w: Tensor, w_scale: Tensor, K: int) -> None:
    """An FP8 weight of K inputs: E4M3 w [N ≥ 1, K] (or its bytes), UE8M0 w_scale per 32 × 32 block."""
    _expect("w", w, (None, K), (torch.float8_e4m3fn, torch.uint8))
    N = w.shape[0]
    if N == 0:
        raise ValueError("w: expected at least one output row, got 0")
    _expect("w_scale", w_scale, (-(-N // fp8_gemm.BLOCK), K // fp8_gemm.BLOCK), (torch.uint8,))


def fp8_linear(
    x_data: Tensor,
    x_scale: Tensor,
    w: Tensor,
    w_scale: Tensor,
    out_dtype: torch.dtype,
    backend: Backend = "torch",
    tuning: FP8GemmTuning | None = None,
) -> Tensor:
    """y [M, N] = x Wᵀ (fp32 accumulation) → out_dtype, from FP8 activations — E4M3 bytes x_data [M, K] and UE8M0
    scales per 32 inputs x_scale [M, K/32], what `quantize_swa_fp8(x)` returns — and an FP8 weight: E4M3 w [N, K]
    (float8_e4m3fn or its bytes) with one UE8M0 scale per 32 × 32 block, w_scale [⌈N/32⌉, K/32]. The reference
    computes in promote(out_dtype, fp32); the Triton kernel in fp32, so an fp64 out_dtype keeps the torch form.
    `tuning`: the Triton launch shape (None: `FP8GemmTuning()`)."""
    M, K = _expect_fp8_rows("x_data", x_data)
    _expect("x_scale", x_scale, (M, K // kv_quant.SWA_BLOCK), (torch.uint8,))
    _expect_fp8_weight(w, w_scale, K)
    backend = _gemm_backend(out_dtype, backend)
    return _tuned(backend, fp8_gemm, "fp8_linear", tuning, x_data, x_scale, w, w_scale, out_dtype)


def casts_in_gemm(rows: int, backend: Backend) -> bool:
    """Whether `fp8_linear_cast` of `rows` tokens casts them inside the GEMM (Triton, `fp8_gemm.casts_inside`): then
    each of the linears reading one input casts it itself, in the launch it takes anyway, rather than sharing a cast
    launch."""
    return backend == "triton" and fp8_gemm.casts_inside(rows)


def fp8_linear_cast(
    x: Tensor, w: Tensor, w_scale: Tensor, backend: Backend = "torch", tuning: FP8GemmTuning | None = None
) -> Tensor:
    """y [M, N] = cast(x) Wᵀ in x's dtype: float activations x [M, K] under the FP8 activation cast
    (`quantize_swa_fp8`, the same bytes), then `fp8_linear`. The Triton form casts inside the GEMM below 32 tokens
    (one launch, not two)."""
    _expect("x", x, (None, None), _WIDE_FLOATS)
    if x.shape[1] % kv_quant.SWA_BLOCK:
        raise ValueError(f"x: inputs must be a multiple of {kv_quant.SWA_BLOCK}, got {x.shape[1]}")
    _expect_fp8_weight(w, w_scale, x.shape[1])
    backend = _gemm_backend(x.dtype, backend)
    return _tuned(backend, fp8_gemm, "fp8_linear_cast", tuning, x, w, w_scale)


def _expect_experts(
    name: str, w: Tensor, scale_name: str, scale: Tensor, inputs: int, stacked: bool = False
) -> tuple[int, int]:
    """Packed E2M1 experts w [E, out, inputs/2] with UE8M0 scales [E, out, inputs/16 or inputs/32] → (E, out).
    `stacked`: two projections stacked (an even number of rows)."""
    _expect(name, w, (None, None, inputs // 2), (torch.uint8,))
    E, out = w.shape[:2]
    if stacked and out % 2:
        raise ValueError(f"{name}: expected W1 and W3 stacked (an even number of rows), got {out}")
    _expect(scale_name, scale, (E, out, None), (torch.uint8,))
    if not moe_gemm.scale_block(inputs, scale):
        raise ValueError(
            f"{scale_name}: expected {inputs // 16} (scales per 16 inputs) or {inputs // 32} (per 32) scales per row "
            f"of {inputs} inputs, got {scale.shape[-1]}"
        )
    return E, out


def _expect_offsets(offsets: Tensor, experts: int) -> None:
    _expect("offsets", offsets, (experts + 1,), _INTS)


def moe_route(
    x: Tensor, weight: Tensor, bias: Tensor, topk: int, norm: bool, scale: float, backend: Backend = "torch"
) -> tuple[Tensor, Tensor]:
    """The MoE gate's choice for x [N, C] with gate weight [E, C] and bias [E] → (weights [N, k] fp32, expert ids
    [N, k] int64): √softplus scores, the k best biased scores (ties to the lower id) in ascending id, their scores
    (over their sum if `norm`) times `scale`. The Triton kernels have no backward and compute in fp32: a gradient to
    carry or fp64 keep the torch form."""
    _expect("x", x, (None, None), _WIDE_FLOATS)
    _expect("gate weight", weight, (None, x.shape[1]), _WIDE_FLOATS)
    _expect("gate bias", bias, (weight.shape[0],))
    if not 1 <= topk <= weight.shape[0]:
        raise ValueError(f"topk must be in 1 … {weight.shape[0]} (the experts), got {topk}")
    if _carries_grad(x, weight) or weight.dtype != torch.float32 or x.dtype == torch.float64:
        backend = "torch"
    return _pick(backend, route, "moe_route")(x, weight, bias, topk, norm, scale)


def moe_pairs(ids: Tensor, n_experts: int, backend: Backend = "torch") -> tuple[Tensor, Tensor]:
    """Expert ids [N, k] (each in 0 … n_experts − 1, unchecked: that would sync) → the (token, slot) pairs sorted by
    expert, on the device without a host sync: order int64 [N·k] (flat pair indices t·k + s, stable; a sorted
    pair's token is order // k), offsets int32 [n_experts + 1] (expert e's pairs: sorted positions offsets[e] …
    offsets[e+1] − 1). Torch sorts and searches (two launches); Triton counts a decode step's few pairs into place
    in one."""
    _expect("ids", ids, (None, None), _INTS)
    if ids.shape[1] < 1 or n_experts < 1:
        raise ValueError(f"ids: need k ≥ 1 slots and n_experts ≥ 1, got k={ids.shape[1]}, n_experts={n_experts}")
    return _pick(backend, moe_gemm, "moe_pairs")(ids, n_experts)


def moe_gate_up(
    x_data: Tensor,
    x_scale: Tensor,
    order: Tensor,
    offsets: Tensor,
    weights: Tensor,
    w13: Tensor,
    s13: Tensor,
    limit: float,
    out_dtype: torch.dtype,
    backend: Backend = "torch",
    tuning: MoEGemmTuning | None = None,
) -> Tensor:
    """Routed experts' first projection, SwiGLU fused, over the (token, slot) pairs sorted by expert (`moe_pairs`):
    h [P, I] = silu(min(g, limit)) · clamp(u, ±limit) · weights.flatten()[order[p]], g | u = x[order[p] // k] · W1ᵀ |
    W3ᵀ of sorted pair p's expert. x: FP8 bytes x_data [N, C] with UE8M0 per 32 x_scale [N, C/32]; order [P] (the
    sorted pairs' flat (token, slot) indices), offsets [E + 1] (expert e's pairs: offsets[e] … offsets[e+1] − 1),
    weights [N, k] (the routing weights by token and slot, applied in fp32); w13: packed E2M1 [E, 2I, C/2] (rows
    0 … I − 1 = W1, I … 2I − 1 = W3) with UE8M0 s13 [E, 2I, C/16] or [E, 2I, C/32] (the block told by the shape).
    Nothing is checked that would need the device's values (a sync). `tuning`: the Triton launch shape (None:
    `MoEGemmTuning()`)."""
    backend = _check_gate_up(x_data, x_scale, order, offsets, weights, w13, s13, out_dtype, backend)
    args = (x_data, x_scale, order, offsets, weights, w13, s13, limit, out_dtype)
    return _tuned(backend, moe_gemm, "moe_gate_up", tuning, *args)


def moe_gate_up_cast(
    x_data: Tensor,
    x_scale: Tensor,
    order: Tensor,
    offsets: Tensor,
    weights: Tensor,
    w13: Tensor,
    s13: Tensor,
    limit: float,
    out_dtype: torch.dtype,
    backend: Backend = "torch",
    tuning: MoEGemmTuning | None = None,
) -> tuple[Tensor, Tensor]:
    """`moe_gate_up`'s h rounded to out_dtype, as `moe_down` reads it: FP8 bytes [P, I] and UE8M0 scales per 32
    [P, I/32], the bytes of `quantize_swa_fp8(h)`. The Triton form casts in the GEMM's epilogue for a few tokens
    (`MoEGemmTuning.cast`): one launch, not two."""
    backend = _check_gate_up(x_data, x_scale, order, offsets, weights, w13, s13, out_dtype, backend)
    if w13.shape[1] // 2 % kv_quant.SWA_BLOCK:
        raise ValueError(f"w13: {w13.shape[1] // 2} intermediate channels are not groups of {kv_quant.SWA_BLOCK}")
    args = (x_data, x_scale, order, offsets, weights, w13, s13, limit, out_dtype)
    return _tuned(backend, moe_gemm, "moe_gate_up_cast", tuning, *args)


def _check_gate_up(
    x_data: Tensor,
    x_scale: Tensor,
    order: Tensor,
    offsets: Tensor,
    weights: Tensor,
    w13: Tensor,
    s13: Tensor,
    out_dtype: torch.dtype,
    backend: Backend,
) -> Backend:
    """The arguments of the gate_up GEMM, each named in a ValueError when wrong → the backend that runs it."""
    N, C = _expect_fp8_rows("x_data", x_data)
    _expect("x_scale", x_scale, (N, C // kv_quant.SWA_BLOCK), (torch.uint8,))
    _expect("order", order, (None,), (torch.int64,))
    _expect("weights", weights, (N, None), _WIDE_FLOATS)
    E, _ = _expect_experts("w13", w13, "s13", s13, C, stacked=True)
    _expect_offsets(offsets, E)
    return _gemm_backend(out_dtype, backend)


def moe_down(
    h_data: Tensor,
    h_scale: Tensor,
    offsets: Tensor,
    w2: Tensor,
    s2: Tensor,
    out_dtype: torch.dtype,
    backend: Backend = "torch",
    tuning: MoEGemmTuning | None = None,
    order: Tensor | None = None,
) -> Tensor:
    """Routed experts' second projection over the sorted pairs: out [P, C] = h · W2ᵀ of each pair's expert, in sorted
    pair order — or, given `order` (`moe_pairs`'), in (token, slot) order: sorted pair p's row at order[p], written
    there by the GEMM. h: FP8 bytes h_data [P, I] with UE8M0 per 32 h_scale [P, I/32] (`quantize_swa_fp8` of
    moe_gate_up's output); offsets [E + 1]; w2: packed E2M1 [E, C, I/2] with UE8M0 s2 [E, C, I/16] or [E, C, I/32].
    `tuning`: as moe_gate_up's."""
    P, inter = _expect_fp8_rows("h_data", h_data)
    _expect("h_scale", h_scale, (P, inter // kv_quant.SWA_BLOCK), (torch.uint8,))
    E, _ = _expect_experts("w2", w2, "s2", s2, inter)
    _expect_offsets(offsets, E)
    if order is not None:
        _expect("order", order, (P,), (torch.int64,))
    backend = _gemm_backend(out_dtype, backend)
    return _tuned(backend, moe_gemm, "moe_down", tuning, h_data, h_scale, offsets, w2, s2, out_dtype, order)
