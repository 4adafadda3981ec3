"""The block-scaled FP8 GEMM: the torch reference against the plain dequantised float matmul, the Triton kernel (in
its interpreter: fp32 dots of decoded codes) against both. Tolerance: fp32 summation order, |Δ| ≤ 2^-20 · Σ_k |x_k w_k|
per output, plus one rounding to the output dtype."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import fp8_linear_case, generator, plain_fp8_operands

from model import kernels
from model.kernels.fp8_gemm import FP8GemmTuning, fp8_linear_cast_triton, fp8_linear_triton

Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def assert_close_to_plain(got: torch.Tensor, case: Case) -> None:
    x, w = plain_fp8_operands(*case, torch.float64)
    want = F.linear(x, w)  # exact: fp64 holds every product and these sums
    bound = 2.0**-20 * F.linear(x.abs(), w.abs()) + torch.finfo(got.dtype).eps * want.abs()
    assert got.shape == want.shape
    assert ((got.double() - want).abs() <= bound).all(), float((got.double() - want).abs().max())


@pytest.mark.parametrize(
    ("M", "N", "K", "dtype"),
    [(1, 40, 64, torch.float32), (5, 100, 96, torch.bfloat16), (33, 65, 256, torch.float32),
     (3, 1, 128, torch.float16), (0, 8, 32, torch.float32)],
)  # fmt: skip
def test_fp8_linear_matches_the_dequantised_matmul(M: int, N: int, K: int, dtype: torch.dtype) -> None:
    """M = 1 (decode), N below and across 32-row blocks and tiles, K a multiple of 32 but not of a K tile (96)."""
    case = fp8_linear_case(generator(M * N + K), M, N, K)
    want = kernels.fp8_linear(*case, dtype)
    assert want.dtype == dtype
    assert_close_to_plain(want, case)
    got = kernels.fp8_linear(*case, dtype, backend="triton")
    assert got.dtype == dtype
    assert_close_to_plain(got, case)


@pytest.mark.parametrize("dot", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "tuning",
    [FP8GemmTuning(split_k=3, block_k=32), FP8GemmTuning(split_k=2), FP8GemmTuning(block_m=16, block_n=32),
     FP8GemmTuning(block_k=256, num_stages=2, num_warps=2)],
)  # fmt: skip
def test_fp8_linear_launch_shapes(tuning: FP8GemmTuning, dot: str) -> None:
    """Both ways (per-chunk rescaled code dots; scales folded into the operands, one dot per K tile), each with K
    split in fp32 partial sums (summed on the device), one K chunk per tile, several token tiles, a tile longer than
    K — with K = 384 the scales come as 32-bit words, at block_k 32 byte by byte."""
    case = fp8_linear_case(generator(7), 20, 40, 384)
    assert_close_to_plain(fp8_linear_triton(*case, torch.float32, replace(tuning, dot=dot)), case)


@pytest.mark.parametrize(("M", "dot"), [(16, "fp32"), (32, "bf16"), (70, "bf16")])
def test_fp8_linear_takes_folded_dots_from_32_tokens(M: int, dot: str) -> None:
    """The default way by M (the interpreter's chunks are fp32), and the folded way across token tiles and a
    partial last one."""
    assert FP8GemmTuning().resolved(M).dot == dot
    case = fp8_linear_case(generator(M), M, 72, 160)
    assert_close_to_plain(fp8_linear_triton(*case, torch.bfloat16), case)


def test_fp8_linear_weight_bytes_and_fp64() -> None:
    """The weight may come as its bytes; an fp64 output is the reference's, exact in fp64 (the Triton kernel computes
    in fp32, so it steps aside)."""
    x_data, x_scale, w, w_scale = fp8_linear_case(generator(3), 4, 48, 64)
    as_bytes = kernels.fp8_linear(x_data, x_scale, w.view(torch.uint8), w_scale, torch.float32, backend="triton")
    assert torch.equal(as_bytes, kernels.fp8_linear(x_data, x_scale, w, w_scale, torch.float32, backend="triton"))
    got = kernels.fp8_linear(x_data, x_scale, w, w_scale, torch.float64, backend="triton")
    assert torch.equal(got, F.linear(*plain_fp8_operands(x_data, x_scale, w, w_scale, torch.float64)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("M", "tuning"),
    [(1, FP8GemmTuning()), (5, FP8GemmTuning(split_k=3, block_k=32)), (20, FP8GemmTuning(block_n=32)),
     (17, FP8GemmTuning(block_m=16, block_k=256)), (40, FP8GemmTuning()),
     (1, FP8GemmTuning(dot="bf16")), (5, FP8GemmTuning(dot="bf16", split_k=3, block_k=32)),
     (17, FP8GemmTuning(dot="bf16", block_m=16, block_k=256))],
)  # fmt: skip
def test_fp8_linear_cast_equals_the_cast_then_the_gemm(M: int, tuning: FP8GemmTuning, dtype: torch.dtype) -> None:
    """Float activations cast inside the GEMM (M < 32, with chunked dots and with folded ones as under batch
    invariance: several token tiles, K splits, one and eight chunks a tile) give the bits of the cast kernel's bytes
    through the GEMM; from 32 tokens the cast kernel runs first. Activations span many binades, with rows of zeros
    and values in E4M3's subnormal range of their block."""
    g = generator(M)
    x = (torch.randn(M, 320, generator=g) * torch.exp2(torch.randint(-12, 12, (M, 320), generator=g))).to(dtype)
    x[M // 2] = 0
    x[0, :32] = torch.tensor([1.0] + [2.0**-14] * 31)
    _, _, w, w_scale = fp8_linear_case(g, 0, 72, 320)
    cast = kernels.quantize_swa_fp8(x, backend="triton")
    want = fp8_linear_triton(*cast, w, w_scale, dtype, tuning)
    got = fp8_linear_cast_triton(x, w, w_scale, tuning)
    assert got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(kernels.fp8_linear_cast(x, w, w_scale), kernels.fp8_linear(*cast, w, w_scale, dtype))


@pytest.mark.parametrize(
    ("name", "x", "w"),
    [("x", torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(8, 64, dtype=torch.uint8)),
     ("x", torch.zeros(4, 48), torch.zeros(8, 48, dtype=torch.uint8)),
     ("w", torch.zeros(4, 64), torch.zeros(8, 32, dtype=torch.uint8))],
)  # fmt: skip
def test_fp8_linear_cast_names_a_bad_argument(name: str, x: torch.Tensor, w: torch.Tensor) -> None:
    w_scale = torch.zeros(1, max(1, w.shape[1] // 32), dtype=torch.uint8)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=f"^{name}:"):
            kernels.fp8_linear_cast(x, w, w_scale, backend=backend)


def bad(case: Case, **change: object) -> dict[str, object]:
    return dict(zip(("x_data", "x_scale", "w", "w_scale"), case, strict=True)) | {"out_dtype": torch.float32} | change


U8 = torch.uint8


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("x_data", {"x_data": torch.zeros(4, 64)}),
        ("x_data", {"x_data": torch.zeros(4, 48, dtype=U8)}),  # K not a multiple of 32
        ("x_scale", {"x_scale": torch.zeros(4, 3, dtype=U8)}),
        ("w", {"w": torch.zeros(48, 32, dtype=U8)}),
        ("w", {"w": torch.zeros(48, 64, dtype=torch.bfloat16)}),
        ("w", {"w": torch.zeros(0, 64, dtype=U8)}),
        ("w_scale", {"w_scale": torch.zeros(1, 2, dtype=U8)}),
        ("out_dtype", {"out_dtype": torch.int32}),
    ],
)
def test_fp8_linear_names_a_bad_argument(name: str, change: dict[str, object]) -> None:
    case = fp8_linear_case(generator(1), 4, 48, 64)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=f"^{name}:"):
            kernels.fp8_linear(**bad(case, **change), backend=backend)


@pytest.mark.parametrize(
    ("tuning", "name"),
    [(FP8GemmTuning(block_n=48), "block_n"), (FP8GemmTuning(block_k=16), "block_k"),
     (FP8GemmTuning(block_m=8), "block_m"), (FP8GemmTuning(dot="fp8"), "dot"),
     (FP8GemmTuning(dot="tf32"), "dot")],  # type: ignore[arg-type]
)  # fmt: skip
def test_fp8_linear_names_a_bad_launch_shape(tuning: FP8GemmTuning, name: str) -> None:
    """Tile sides must suit tl.arange and tl.dot; the interpreter has no FP8 dot; the dots are one of three."""
    with pytest.raises(ValueError, match=f"tuning.{name}"):
        fp8_linear_triton(*fp8_linear_case(generator(1), 2, 32, 64), torch.float32, tuning)


@pytest.mark.parametrize("invariant", [False, True])
def test_fp8_linear_under_batch_invariance_computes_a_row_alike_in_any_batch(monkeypatch, invariant: bool) -> None:
    """On a GPU of 132 SMs (emulated: the interpreter has one), a token alone and the same token among 96: by default
    the launch differs (chunked code dots and 2 K splits at M = 1, folded dots and one split at M = 96); under batch
    invariance it is the same, and so are the row's bits."""
    from model.kernels import fp8_gemm, invariance

    monkeypatch.setattr(fp8_gemm, "multiprocessors", lambda: 132)
    monkeypatch.setattr(invariance, "_invariant", invariant)
    x_data, x_scale, w, w_scale = fp8_linear_case(generator(3), 96, 64, 1024)
    alone = fp8_linear_triton(x_data[:1], x_scale[:1], w, w_scale, torch.float32)
    among = fp8_linear_triton(x_data, x_scale, w, w_scale, torch.float32)
    assert_close_to_plain(among, (x_data, x_scale, w, w_scale))
    assert torch.equal(alone[0], among[0]) == invariant
