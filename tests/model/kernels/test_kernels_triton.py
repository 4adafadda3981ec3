"""Every Triton kernel against its torch reference, in Triton's CPU interpreter, on fresh random inputs.

Tolerances follow the formats: quantised bytes, candidate masks and top-k indices are exact (ties included: both
backends take equal scores in position order);
indexer scores and attention differ from the reference only by fp32 summation order (the interpreter dots in
fp32; the GPU's bf16 dots are checked at real sizes by `bench/kernels.py --check`).
"""

from dataclasses import replace

import pytest
import torch
from kernel_cases import (
    assert_indexer_scores_close,
    attention_case,
    candidate_case,
    generator,
    indexer_case,
    lowest_position_topk,
    tied_topk_case,
    topk_case,
)
from torch import Tensor

from model import DecodeBatch, Transformer, encode_prefill, kernels, quant
from model.graphs import StepGraphs
from model.kernels.formats import dense_rows
from model.kernels.sparse_attn import sparse_attention_triton
from model.kernels.topk import TopKTuning, topk_indices_triton
from model.norm import rms_norm

FORMATS = ["kv_fp4", "index_fp4", "swa_fp8"]


def quantise(fmt: str, x: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return getattr(kernels, f"quantize_{fmt}")(x, backend=backend)


def dequantise(fmt: str, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, backend: str) -> torch.Tensor:
    return getattr(kernels, f"dequantize_{fmt}")(data, scale, dtype, backend=backend)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("shape", "dtype", "magnitude"),
    [((3, 64), torch.float32, 1.0), ((2, 5, 512), torch.bfloat16, 3.0), ((7, 96), torch.float16, 1e-3),
     ((1, 32), torch.float32, 1e30), ((4, 128), torch.float32, 1e-30), ((0, 64), torch.float32, 1.0)],
)  # fmt: skip
def test_quantise_bytes_are_exact(fmt: str, shape: tuple[int, ...], dtype: torch.dtype, magnitude: float) -> None:
    x = (torch.randn(shape, generator=generator(shape[-1])) * magnitude).to(dtype)
    if x.numel():
        x.view(-1)[0] = 0.0
    want = quantise(fmt, x, "torch")
    got = quantise(fmt, x, "triton")
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    for out_dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):  # bit for bit: −0 too
        got_values = dequantise(fmt, *want, out_dtype, "triton").view(bits)
        assert torch.equal(got_values, dequantise(fmt, *want, out_dtype, "torch").view(bits))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy warns about the inf block
@pytest.mark.parametrize("non_finite", [False, True])  # bf16 FP4: a finite tile takes the fp32-arithmetic rounding
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantise_ties_saturation_and_specials(fmt: str, dtype: torch.dtype, non_finite: bool) -> None:
    """Blocks made of exact rounding midpoints (ties to even), saturated maxima, zeros, tiny (subnormal-scale)
    blocks, and optionally infinities and NaN."""
    g = generator(1)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 17.0, 19.0, 447.0, 448.0, 0.0, -0.0])
    x = midpoints[torch.randint(0, len(midpoints), (16, 64), generator=g)]
    x = x * torch.where(torch.rand(16, 64, generator=g) < 0.5, -1.0, 1.0) * 2.0 ** torch.randint(-8, 8, (16, 1))
    x[3, :32] = 0.0  # an all-zero block: the amax floor decides the scale
    x[4] *= 2.0**-16  # blocks whose E4M3 scale is subnormal (coarse: quotients above 6 saturate)
    if non_finite:
        x[5, 7] = float("inf")
        x[6, 40] = float("nan")
    x = x.to(dtype)
    want = quantise(fmt, x, "torch")
    got = quantise(fmt, x, "triton")
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("fmt", ["kv_fp4", "index_fp4"])
def test_fp4_quantise_of_every_finite_bf16_value_is_exact(fmt: str) -> None:
    """Each of the 65,280 finite bf16 values, in blocks shuffled twice (so each meets two block maxima / scales),
    quantises to the reference's bytes: the fp32-arithmetic E2M1 rounding of the bf16 kernel, exhaustively."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = bits[bits.isfinite()]
    g = generator(3)
    x = torch.cat([finite[torch.randperm(len(finite), generator=g)] for _ in range(2)]).reshape(-1, 512)
    want = quantise(fmt, x, "torch")
    got = quantise(fmt, x, "triton")
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])


def test_fp4_kv_quotients_on_midpoints_of_odd_scales_are_exact() -> None:
    """bf16 blocks whose E4M3 scale is not a power of two (1.125, 1.75, …) and whose values are midpoints × scale:
    the quotient the fast bf16 kernel forms by a reciprocal lands exactly on each tie, as the division does."""
    g = generator(2)
    scales = quant.e4m3_decode(torch.randint(40, 120, (32, 4, 1), generator=g, dtype=torch.uint8))
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0])
    x = midpoints[torch.randint(0, len(midpoints), (32, 4, 16), generator=g)] * scales
    x[..., 0] = 6.0 * scales[..., 0]  # the block maximum that makes the scale exactly `scales`
    x = (x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)).reshape(32, 64).to(torch.bfloat16)
    want = quantise("kv_fp4", x, "torch")
    assert torch.equal(quant.e4m3_decode(want[1]), scales.reshape(32, 4))  # the case is what it claims
    got = quantise("kv_fp4", x, "triton")
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_dequantise_bad_scale_shape_is_named() -> None:
    data, scale = kernels.quantize_kv_fp4(torch.randn(2, 32))
    with pytest.raises(ValueError, match="scale shape"):
        kernels.dequantize_kv_fp4(data, scale[:, :1], torch.float32, backend="triton")


@pytest.mark.parametrize(
    ("B", "T", "H", "Di", "S"),
    [(2, 1, 4, 64, 50), (1, 3, 32, 128, 70), (3, 5, 3, 32, 33), (1, 1, 8, 128, 1), (2, 2, 2, 64, 0)],
)
def test_indexer_scores(B: int, T: int, H: int, Di: int, S: int) -> None:
    case = indexer_case(generator(B * S + T), B, T, H, Di, S)
    want = kernels.indexer_scores(*case)
    got = kernels.indexer_scores(*case, backend="triton")
    assert_indexer_scores_close(got, want, case)


@pytest.mark.parametrize(
    ("S", "block_size", "topk_blocks", "tied"), [(37, 8, 2, True), (20, 4, 10, False), (300, 8, 5, True)]
)
def test_candidate_mask_is_exact(S: int, block_size: int, topk_blocks: int, tied: bool) -> None:
    scores, n_visible = candidate_case(generator(S), S, tied)
    want = kernels.candidate_mask(scores, n_visible, block_size, topk_blocks)
    got = kernels.candidate_mask(scores, n_visible, block_size, topk_blocks, backend="triton")
    narrow = kernels.candidate_mask(scores, n_visible.int(), block_size, topk_blocks, backend="triton")
    assert torch.equal(narrow, got)  # int32 counts read alike
    assert torch.equal(got, want)


# every path of the Triton top-k, reached on small rows by shrinking its launch parameters
DIRECT = TopKTuning()  # one program per row, the row in registers
DIRECT_STREAMED = TopKTuning(tile=64)  # one program per row, streaming the row in tiles
GROUPS = TopKTuning(direct_max=64)  # group maxima → threshold → gather the passing groups → select in registers
GROUPS_STREAMED = TopKTuning(direct_max=64, group_size=4, tile=32)  # the candidates streamed in tiles
OVERFLOW = TopKTuning(direct_max=64, group_size=16, gather=16, covered_groups=1)  # more passing groups than the
# gathering programs cover: select from the row
PATHS = [DIRECT, DIRECT_STREAMED, GROUPS, GROUPS_STREAMED, OVERFLOW]


@pytest.mark.parametrize(
    ("R", "L", "k", "dtype", "paths"),
    [
        (3, 50, 8, torch.float32, DIRECT),
        (4, 300, 16, torch.bfloat16, DIRECT),
        (2, 7, 16, torch.float32, DIRECT),  # k beyond the row: −1 padding
        (2, 150, 8, torch.float16, DIRECT_STREAMED),
        (3, 300, 8, torch.float32, GROUPS),
        (5, 1000, 20, torch.float16, GROUPS),
        (3, 300, 8, torch.bfloat16, GROUPS_STREAMED),
        (3, 300, 8, torch.bfloat16, OVERFLOW),
        (2, 40_000, 64, torch.bfloat16, TopKTuning()),  # the defaults: a small batch, so 2 K groups (of 32 here)
        (3, 300, 8, torch.float32, replace(GROUPS, gather=4096)),  # one gathering program per row
        (3, 1000, 20, torch.bfloat16, replace(GROUPS, gather=32)),  # a few passing groups per gathering program
        (2, 300, 8, torch.float32, replace(GROUPS, gather=1, covered_groups=100)),  # programs with no group
    ],
)
def test_topk_indices(R: int, L: int, k: int, dtype: torch.dtype, paths: TopKTuning) -> None:
    scores, lengths = topk_case(generator(L + k), R, L, dtype)
    got = topk_indices_triton(scores, k, lengths, paths)
    assert torch.equal(got, kernels.topk_indices(scores, k, lengths))  # bf16 / fp16 rows hold ties: the same ones
    assert torch.equal(topk_indices_triton(scores, k, lengths.int(), paths), got)  # int32 lengths read alike
    assert torch.equal(topk_indices_triton(scores, k, None, paths), kernels.topk_indices(scores, k))


@pytest.mark.parametrize("paths", PATHS)
def test_topk_ties_match_the_definition(paths: TopKTuning) -> None:
    scores, lengths = tied_topk_case(generator(PATHS.index(paths)), 4, 90, torch.bfloat16)
    for k in (1, 7, 40):
        assert torch.equal(topk_indices_triton(scores, k, lengths, paths), lowest_position_topk(scores, k, lengths))


def search_edge_rows(g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose k-th key sits where a search between bounds could go wrong: bounds equal (all tied), bounds a few
    representable values apart, a binade boundary between them, the sign between them, every score negative."""
    L = 120
    near = 1.0 + torch.randint(0, 6, (L,), generator=g) / 64
    straddle = torch.tensor([1.0 - 2**-7, 1.0, 1.0 + 2**-7]).repeat(L // 3)[torch.randperm(L, generator=g)]
    signs = torch.randn(L, generator=g)
    negative = -torch.rand(L, generator=g) - 0.5
    return torch.stack([torch.full((L,), 0.75), near, straddle, signs, negative]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("paths", PATHS)
def test_topk_search_range_edges(paths: TopKTuning, dtype: torch.dtype) -> None:
    scores = search_edge_rows(generator(5), dtype)
    for k in (30,) if paths.tile is not None else (1, 30, 61):  # the streamed paths are slow in the interpreter: one k
        assert torch.equal(topk_indices_triton(scores, k, None, paths), lowest_position_topk(scores, k, None))


@pytest.mark.parametrize(("knob", "value"), [("gather", 3), ("tile", 48), ("tile", 65536)])
def test_topk_names_a_bad_launch_knob(knob: str, value: int) -> None:
    with pytest.raises(ValueError, match=knob):
        TopKTuning(**{knob: value})


def test_topk_ties_go_to_the_lowest_positions() -> None:
    scores = torch.zeros(3, 130, dtype=torch.bfloat16)
    scores[1, ::3] = 1.0
    scores[2, 40:] = float("-inf")
    for paths in (DIRECT, replace(OVERFLOW, covered_groups=2)):
        got = topk_indices_triton(scores, 10, None, paths)
        assert got[0].tolist() == list(range(10))
        assert got[1].tolist() == list(range(0, 30, 3))
        assert got[2].tolist() == list(range(10))
    assert kernels.topk_indices(scores, 0, backend="triton").shape == (3, 0)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(
    ("B", "T", "H", "D", "W", "N", "K"), [(2, 2, 3, 64, 5, 9, 4), (1, 3, 20, 32, 40, 50, 30), (2, 1, 4, 96, 8, 30, 20)]
)
def test_sparse_attention(B: int, T: int, H: int, D: int, W: int, N: int, K: int, splits: int) -> None:
    case = attention_case(generator(W + N), B, T, H, D, W, N, K)
    want = kernels.sparse_attention(*case)
    got = sparse_attention_triton(*case, splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[0, 0].abs().max() == 0  # the query that sees only its sink


@pytest.mark.parametrize("block_h", [32, 64])
def test_sparse_attention_head_blocks_wider_than_the_combine(block_h: int) -> None:
    """Split programs of 32 / 64 heads, merged by combine programs of 16 (ragged: 40 heads)."""
    case = attention_case(generator(block_h), 2, 1, 40, 32, 6, 40, 24)
    got = sparse_attention_triton(*case, splits=3, block_h=block_h)
    torch.testing.assert_close(got, kernels.sparse_attention(*case), rtol=1e-5, atol=1e-6)


def test_sparse_attention_with_no_entries_stored() -> None:
    case = list(attention_case(generator(4), 2, 3, 2, 32, 6, 5, 4))
    case[6:9] = case[6][:, :0], case[7][:, :0], torch.full_like(case[8], -1)  # N = 0, every slot −1
    torch.testing.assert_close(sparse_attention_triton(*case), kernels.sparse_attention(*case), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_applies_rope_as_its_own_launches_would(splits: int, dtype: torch.dtype) -> None:
    """RoPE on q and RoPE⁻¹ on the output inside the attention kernel (either output path) equal, bit for bit, the
    RoPE kernel run on q and on the output around it; the torch reference applies the torch RoPE the same way."""
    B, T, H, D = 2, 3, 5, 96  # 96 of a 128-wide tile: the padding dims stay out of the rotation
    q, *rest = attention_case(generator(8), B, T, H, D, 7, 20, 6)
    q = q.to(dtype)
    positions = torch.tensor([[9, 10, 11], [70000, 70001, 70002]])
    inv_freq = 10000.0 ** -(torch.arange(0, 16, 2, dtype=torch.float64) / 16)  # the last 16 dims rotate
    rope = (positions, inv_freq)
    got = sparse_attention_triton(q, *rest, rope=rope, splits=splits)
    plain = sparse_attention_triton(
        kernels.rope_rotate(q, *rope, inverse=False, backend="triton"), *rest, splits=splits
    )
    assert torch.equal(got, kernels.rope_rotate(plain, *rope, inverse=True, backend="triton"))
    assert not torch.equal(got, sparse_attention_triton(q, *rest, splits=splits))
    want = kernels.rope_rotate(kernels.sparse_attention(kernels.rope_rotate(q, *rope, inverse=False), *rest), *rope,
                               inverse=True)  # fmt: skip
    assert torch.equal(kernels.sparse_attention(q, *rest, rope=rope), want)


@pytest.mark.parametrize("splits", [1, 3])
def test_attention_and_rope_read_queries_by_their_strides(splits: int) -> None:
    """Queries that are heads of a column view (wq_b's share of a stacked GEMM's output) give the outputs of the same
    queries made contiguous: sparse attention (with its RoPE and without) and the RoPE kernel."""
    B, T, H, D = 2, 3, 5, 96
    q, *rest = attention_case(generator(18), B, T, H, D, 7, 20, 6)
    wide = torch.randn(B, T, H * D + 40, generator=generator(19))
    wide[..., 8 : 8 + H * D] = q.flatten(-2)
    view = wide[..., 8 : 8 + H * D].unflatten(-1, (H, D))
    assert not view.is_contiguous()
    assert torch.equal(view, q)
    rope = (torch.tensor([[9, 10, 11], [70000, 70001, 70002]]), torch.rand(8, dtype=torch.float64))
    for r in (None, rope):
        assert torch.equal(sparse_attention_triton(view, *rest, rope=r, splits=splits),
                           sparse_attention_triton(q, *rest, rope=r, splits=splits))  # fmt: skip
    for inverse in (False, True):
        rotated = kernels.rope_rotate(view, *rope, inverse=inverse, backend="triton")
        assert rotated.is_contiguous()
        assert torch.equal(rotated, kernels.rope_rotate(q, *rope, inverse=inverse, backend="triton"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swa_cast_applies_rope_as_its_own_launch_would(dtype: torch.dtype) -> None:
    """The window latent's RoPE inside the FP8 cast (rows of their own positions, the rows of one program among
    them) gives the bytes and scales of the RoPE kernel's output cast; the torch reference likewise."""
    x = (torch.randn(3, 5, 96, generator=generator(10)) * 4).to(dtype)
    positions = torch.randint(0, 1 << 20, (3, 5), generator=generator(11))
    rope = (positions, 10000.0 ** -(torch.arange(0, 32, 2, dtype=torch.float64) / 32))  # the last 32 dims rotate
    fused = kernels.quantize_swa_fp8(x, "triton", rope)
    apart = kernels.quantize_swa_fp8(kernels.rope_rotate(x, *rope, inverse=False, backend="triton"), "triton")
    assert all(torch.equal(a, b) for a, b in zip(fused, apart, strict=True))
    assert not torch.equal(fused[0], kernels.quantize_swa_fp8(x, "triton")[0])
    reference = kernels.quantize_swa_fp8(kernels.rope_rotate(x, *rope, inverse=False), "torch")
    assert all(torch.equal(a, b) for a, b in zip(kernels.quantize_swa_fp8(x, "torch", rope), reference, strict=True))
    with pytest.raises(ValueError, match=r"rope positions: expected integers over \[3, 5\]"):
        kernels.quantize_swa_fp8(x, "triton", (positions[:, :4], rope[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swa_cast_norms_and_rotates_as_their_own_launches_would(dtype: torch.dtype) -> None:
    """kv_norm, RoPE and the cast in one launch (the norm and the rotation in registers) give the bytes of the norm
    kernel's rows, rotated by the RoPE kernel, then cast; the torch reference is rms_norm, RoPE, cast."""
    x = (torch.randn(3, 5, 96, generator=generator(12)) * 4).to(dtype)
    positions = torch.randint(0, 1 << 20, (3, 5), generator=generator(13))
    rope = (positions, 10000.0 ** -(torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    norm = ((torch.rand(96, generator=generator(14)) + 0.5).to(dtype), 1e-6)
    fused = kernels.quantize_swa_fp8(x, "triton", rope, norm)
    normed, _, _ = kernels.norm_cast(x, None, *norm, backend="triton")
    apart = kernels.quantize_swa_fp8(kernels.rope_rotate(normed, *rope, inverse=False, backend="triton"), "triton")
    assert all(torch.equal(a, b) for a, b in zip(fused, apart, strict=True))
    reference = kernels.quantize_swa_fp8(kernels.rope_rotate(rms_norm(x, *norm), *rope, inverse=False), "torch")
    assert all(
        torch.equal(a, b) for a, b in zip(kernels.quantize_swa_fp8(x, "torch", rope, norm), reference, strict=True)
    )
    with pytest.raises(ValueError, match="norm weight: expected shape"):
        kernels.quantize_swa_fp8(x, "triton", rope, (norm[0][:64], 1e-6))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_column_view_is_cast_as_its_copy_is(fmt: str, dtype: torch.dtype) -> None:
    """Rows read by their stride — a column view of a stacked GEMM's output, as the window latent is — give the bytes
    and scales of the same rows made contiguous (the window cast's RoPE and norm too)."""
    x = (torch.randn(3, 5, 160, generator=generator(15)) * 4).to(dtype)[..., 32:128]
    assert not x.is_contiguous()
    quantize = getattr(kernels, f"quantize_{fmt}")
    strided, dense = quantize(x, "triton"), quantize(x.contiguous(), "triton")
    assert all(torch.equal(a, b) for a, b in zip(strided, dense, strict=True))
    if fmt == "swa_fp8":
        rope = (torch.randint(0, 1 << 20, (3, 5), generator=generator(16)), torch.rand(16, dtype=torch.float64))
        norm = ((torch.rand(96, generator=generator(17)) + 0.5).to(dtype), 1e-6)
        strided, dense = (kernels.quantize_swa_fp8(t, "triton", rope, norm) for t in (x, x.contiguous()))
        assert all(torch.equal(a, b) for a, b in zip(strided, dense, strict=True))


@pytest.mark.parametrize(
    ("positions", "inv_freq", "match"),
    [
        (torch.zeros(2, 4, dtype=torch.int64), torch.ones(8), "rope positions"),
        (torch.zeros(2, 3), torch.ones(8), "rope positions"),
        (torch.zeros(2, 3, dtype=torch.int64), torch.ones(6), "12 rotary dims"),
        (torch.zeros(2, 3, dtype=torch.int64), torch.ones(64), "128 rotary dims"),
    ],
)
def test_sparse_attention_names_a_bad_rope(positions: torch.Tensor, inv_freq: torch.Tensor, match: str) -> None:
    case = attention_case(generator(9), 2, 3, 2, 64, 5, 9, 4)
    with pytest.raises(ValueError, match=match):
        kernels.sparse_attention(*case, rope=(positions, inv_freq))


def test_sparse_attention_keeps_the_query_dtype() -> None:
    case = attention_case(generator(5), 1, 1, 16, 64, 8, 16, 8)
    q = case[0].bfloat16()
    got = kernels.sparse_attention(q, *case[1:], backend="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, kernels.sparse_attention(q, *case[1:]), rtol=1e-2, atol=1e-2)


def test_default_backend_without_gpu() -> None:
    assert kernels.default_backend() == ("triton" if torch.cuda.is_available() else "torch")


def test_kernels_read_the_cache_views_in_place() -> None:
    """The packed cache passes `[:, :n]` views of buffers with room for more entries (not contiguous for B > 1):
    the indexer and attention kernels read them where they lie, with the results of contiguous copies."""
    case = list(attention_case(generator(6), 2, 2, 3, 64, 5, 9, 4))
    views = [torch.cat((t, torch.zeros_like(t[:, :7])), dim=1)[:, :9] for t in case[6:8]]  # [B, 9 of 16, ·]
    assert not views[0].is_contiguous()
    assert dense_rows(views[0]).data_ptr() == views[0].data_ptr()
    want = kernels.sparse_attention(*case)
    case[6:8] = views
    torch.testing.assert_close(sparse_attention_triton(*case), want, rtol=1e-5, atol=1e-6)

    index = list(indexer_case(generator(7), 2, 1, 4, 64, 30))
    want = kernels.indexer_scores(*index)
    index[3:5] = [torch.cat((t, torch.ones_like(t[:, :5])), dim=1)[:, :30] for t in index[3:5]]
    got = kernels.indexer_scores(*index, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_topk_of_the_scores_decode_steps_produce(tiny: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inputs of every top-k that real decode steps run — a plain step, and the static one a CUDA graph captures
    (rows padded to a bucket at position 0, views over every reserved entry, masked by their lengths) — selected by
    every path of the Triton kernel exactly as by the reference."""
    captured: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
    select = kernels.topk_indices

    def keep(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, backend: str = "torch"):
        captured.append((scores.clone(), k, None if lengths is None else lengths.clone()))
        return select(scores, k, lengths, backend)

    monkeypatch.setattr(kernels, "topk_indices", keep)
    gen = generator(7)
    prompts = [encode_prefill(tiny, torch.randint(0, tiny.args.vocab_size, (n,), generator=gen)) for n in (70, 33)]
    plain, static = DecodeBatch(tiny, 4), DecodeBatch(tiny, 4)
    static.graphs = StepGraphs(tiny, static.cache, buckets=(4,), capture=False)
    inputs = []
    for batch in (plain, static):
        for out in prompts:
            batch.join(out.blocks, out.encoder_state)
        captured.clear()  # (the joins' replays)
        batch.decode_step(torch.randint(0, tiny.args.vocab_size, (2, 1), generator=gen))
        inputs += [captured[0], captured[-1]]  # the first and last index layers' (the interpreter is slow)
    assert [scores.shape[0] for scores, _, _ in inputs] == [2, 2, 4, 4]  # the static step: 2 padding rows
    for scores, k, lengths in inputs:
        want = select(scores, k, lengths)
        for paths in PATHS:
            assert torch.equal(topk_indices_triton(scores, k, lengths, paths), want)


def _alone(case: tuple, rope: tuple[Tensor, Tensor], b: int, t: int) -> Tensor:
    """Query (b, t) of an attention case launched by itself: its row's keys, its own window slots and entries."""
    q, swa_data, swa_scale, new_data, new_scale, swa_idx, kv_data, kv_scale, idx, sink, scale = case
    row, query = slice(b, b + 1), (slice(b, b + 1), slice(t, t + 1))
    keys = (swa_data[row], swa_scale[row], new_data[row], new_scale[row], swa_idx[query])
    one = (q[query], *keys, kv_data[row], kv_scale[row], idx[query], sink, scale)
    return sparse_attention_triton(*one, rope=(rope[0][query], rope[1]))[0, 0]


@pytest.mark.parametrize("invariant", [False, True])
def test_sparse_attention_under_batch_invariance_computes_a_query_alike_in_any_batch(monkeypatch, invariant: bool):
    """On a GPU of 132 SMs (emulated), a query alone has its 5 key tiles split 5 ways, among 32 queries (4 rows × 8
    verify positions) 3 ways; under batch invariance the layer's shape splits them 2 ways either way, and each
    query's output bits are what it gets alone."""
    from model.kernels import invariance, sparse_attn

    monkeypatch.setattr(sparse_attn, "multiprocessors", lambda: 132)
    monkeypatch.setattr(invariance, "_invariant", invariant)
    B, T, H, D = 4, 8, 2, 32
    case = attention_case(generator(31), B, T, H, D, 20, 60, 40)  # 2 window tiles + 3 entry tiles of 16 keys
    assert sparse_attn._invariant_splits(5, 16, H, D, D) == 2
    rope = (torch.arange(B * T).view(B, T) + 100, 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    among = sparse_attention_triton(*case, rope=rope)
    alone = torch.stack([torch.stack([_alone(case, rope, b, t) for t in range(T)]) for b in range(B)])
    torch.testing.assert_close(among, kernels.sparse_attention(*case, rope=rope), rtol=1e-5, atol=1e-6)
    assert torch.equal(among, alone) == invariant
