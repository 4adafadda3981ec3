"""The grouped MoE GEMMs over packed MXFP4 experts: the pair bookkeeping against a Python oracle; the torch references
against the plain dequantised float math (every pair through its expert's dequantised weights, in fp64); the Triton
kernels (in the interpreter: fp32 dots) against the same. Tolerance: fp32 summation order (2^-20 of the largest
output), plus one rounding to the output dtype."""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import generator, moe_case

from model import kernels, quant
from model.kernels.moe_gemm import MoEGemmTuning, decoded_rows

LIMIT = 0.15  # the SwiGLU clamps: below the gate and up magnitudes of these weights, so both clamps bite


def python_pairs(ids: torch.Tensor, n_experts: int) -> tuple[list[int], list[int], list[int]]:
    """The definition: pairs t·k + s ordered by (expert, t·k + s); the count prefix sums."""
    flat = ids.flatten().tolist()
    order = sorted(range(len(flat)), key=lambda i: (flat[i], i))
    counts = [flat.count(e) for e in range(n_experts)]
    return order, [0, *itertools.accumulate(counts)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("N", "k", "E"), [(7, 3, 5), (1, 1, 1), (4, 2, 16), (0, 2, 3), (64, 2, 8), (70, 6, 200), (700, 6, 8)]
)
def test_moe_pairs_match_the_definition(N: int, k: int, E: int, backend: str) -> None:
    """Repeated experts in a token and experts without pairs included; Triton's counting sort over several programs
    (a batch-64 step's 128 pairs over eight) and several blocks of offsets (420 pairs, 200 experts), and torch's sort
    past its reach (4,200 pairs)."""
    ids = torch.randint(0, E, (N, k), generator=generator(N * k + E))
    order, offsets = kernels.moe_pairs(ids, E, backend)
    assert (order.dtype, offsets.dtype) == (torch.int64, torch.int32)
    assert (order.tolist(), offsets.tolist()) == python_pairs(ids, E)


@pytest.mark.parametrize(("N", "K", "slots"), [(5, 96, 3), (3, 1024, 1), (20, 64, 0), (0, 32, 0)])
def test_decoded_rows_are_the_dequantised_rows_evens_then_odds(N: int, K: int, slots: int) -> None:
    """The grouped GEMMs' activation operand: bf16 rows, bit-equal to the dequantised FP8 rows (exact in bf16), the
    even inputs then the odd ones — each pair's token's row (order // slots) or the rows in order; a K tail (96 of a
    128-wide tile), K over two tiles with its scales as 32-bit words, no rows."""
    x_data, x_scale = quant.fp8_quant(torch.randn(N, K, generator=generator(N + K)) * 100)
    order = torch.randperm(max(N, 1) * slots, generator=generator(K))[: 2 * N] if slots else None
    got = decoded_rows(x_data, x_scale, order, slots)
    want = quant.fp8_dequant(x_data, x_scale, dtype=torch.bfloat16)
    want = want if order is None else want[order // slots]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), torch.cat([want[:, 0::2], want[:, 1::2]], 1).view(torch.int16))


def plain_moe(case: tuple[torch.Tensor, ...], order: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dequantised float math in fp64, pair by pair in sorted order: (gate_up's h, down's output of the FP8 h)."""
    x_data, x_scale, ids, weights, w13, s13, w2, s2 = case
    C, I = x_data.shape[1], w2.shape[2] * 2
    experts = ids.flatten()[order]
    x = quant.fp8_dequant(x_data, x_scale, dtype=torch.float64)[order // ids.shape[1]]
    w13 = quant.fp4_dequant_ue8m0(w13, s13, C // s13.shape[-1], torch.float64)[experts]
    gate, up = torch.einsum("pc,poc->po", x, w13).chunk(2, dim=-1)
    plain_h = F.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT) * weights.flatten()[order, None].double()
    w2 = quant.fp4_dequant_ue8m0(w2, s2, I // s2.shape[-1], torch.float64)[experts]
    return plain_h, torch.einsum("pi,pci->pc", quant.fp8_dequant(*quant.fp8_quant(h), dtype=torch.float64), w2)


def assert_close_to_plain(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    assert got.shape == want.shape
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want, rtol=2 * torch.finfo(dtype).eps, atol=2.0**-20 * scale)


def one_expert(N: int, k: int, E: int) -> torch.Tensor:
    """Every token's slots on the same k experts, E − 1 first: one expert holds N pairs per slot."""
    return torch.arange(E - 1, E - 1 - k, -1).expand(N, k)


@pytest.mark.parametrize(
    ("N", "k", "E", "C", "I", "block", "dtype", "ids", "tuning"),
    [
        (5, 2, 4, 64, 32, 32, torch.float32, None, MoEGemmTuning()),
        (3, 2, 8, 96, 64, 16, torch.bfloat16, None, MoEGemmTuning(block_k=64)),  # empty experts, a K tail
        (1, 1, 3, 256, 64, 32, torch.float32, None, MoEGemmTuning()),  # one token; scales read as words
        # fewer pairs than experts (a column per pair): experts shared by two pairs, empty ones between, the last one
        (2, 3, 16, 64, 32, 32, torch.float32, torch.tensor([[0, 5, 15], [5, 9, 15]]), MoEGemmTuning()),
        (20, 2, 4, 64, 64, 16, torch.float32, one_expert(20, 2, 4), MoEGemmTuning(block_n=32)),  # 20 pairs: 2 tiles
        # chunked code dots (fp32 codes: the interpreter's form of "fp8"): a K tail, words and bytes of scales
        (5, 2, 4, 96, 64, 32, torch.float32, None, MoEGemmTuning(dot="fp32")),
        (20, 2, 4, 256, 64, 32, torch.bfloat16, one_expert(20, 2, 4), MoEGemmTuning(dot="fp32", block_n=32)),
    ],
)
def test_moe_gemms_match_the_dequantised_math(
    N: int,
    k: int,
    E: int,
    C: int,
    I: int,
    block: int,
    dtype: torch.dtype,
    ids: torch.Tensor | None,
    tuning: MoEGemmTuning,
) -> None:
    case = moe_case(generator(N + E + C), N, k, E, C, I, block, ids)
    x_data, x_scale, ids, weights, w13, s13, w2, s2 = case
    order, offsets = kernels.moe_pairs(ids, E)
    h = kernels.moe_gate_up(x_data, x_scale, order, offsets, weights, w13, s13, LIMIT, dtype)
    plain_h, plain_out = plain_moe(case, order, h)
    assert_close_to_plain(h, plain_h, dtype)
    got = kernels.moe_gate_up(
        x_data, x_scale, order, offsets, weights, w13, s13, LIMIT, dtype, backend="triton", tuning=tuning
    )
    assert_close_to_plain(got, plain_h, dtype)
    # h as moe_down reads it: the cast's bytes of the rounded h, cast in the epilogue (whole 32-column groups per
    # program) or by the cast kernel after the GEMM
    for cast in (True, False):
        fp8 = kernels.moe_gate_up_cast(*case[:2], order, offsets, weights, w13, s13, LIMIT, dtype, "triton",
                                       dataclasses.replace(tuning, cast=cast))  # fmt: skip
        assert all(map(torch.equal, fp8, kernels.quantize_swa_fp8(got, "triton")))
    fp8 = kernels.moe_gate_up_cast(x_data, x_scale, order, offsets, weights, w13, s13, LIMIT, dtype)
    assert all(map(torch.equal, fp8, kernels.quantize_swa_fp8(h)))
    h_data, h_scale = quant.fp8_quant(h)
    assert_close_to_plain(kernels.moe_down(h_data, h_scale, offsets, w2, s2, dtype), plain_out, dtype)
    got = kernels.moe_down(h_data, h_scale, offsets, w2, s2, dtype, backend="triton", tuning=tuning)
    assert_close_to_plain(got, plain_out, dtype)
    for backend, sorted_out in (("torch", kernels.moe_down(h_data, h_scale, offsets, w2, s2, dtype)), ("triton", got)):
        # given the order, each pair's row lands at its (token, slot) place: the sorted rows, unsorted
        scattered = kernels.moe_down(h_data, h_scale, offsets, w2, s2, dtype, backend, tuning, order=order)
        assert torch.equal(scattered[order], sorted_out)


def test_moe_gemms_in_fp64_are_the_reference() -> None:
    """An fp64 output (an fp64 model) takes the reference, which computes in fp64, on either backend."""
    case = moe_case(generator(2), 3, 2, 4, 64, 32, 32)
    x_data, x_scale, ids, weights, w13, s13, w2, s2 = case
    order, offsets = kernels.moe_pairs(ids, 4)
    args = (x_data, x_scale, order, offsets, weights, w13, s13, LIMIT, torch.float64)
    h = kernels.moe_gate_up(*args, backend="triton")
    plain_h, plain_out = plain_moe(case, order, h)
    torch.testing.assert_close(h, plain_h, rtol=1e-12, atol=1e-15)
    out = kernels.moe_down(*quant.fp8_quant(h), offsets, w2, s2, torch.float64, backend="triton")
    torch.testing.assert_close(out, plain_out, rtol=1e-12, atol=1e-15)


def gate_up_args(**change: object) -> dict[str, object]:
    x_data, x_scale, ids, weights, w13, s13, _, _ = moe_case(generator(1), 3, 2, 4, 64, 32, 32)
    order, offsets = kernels.moe_pairs(ids, 4)
    names = ("x_data", "x_scale", "order", "offsets", "weights", "w13", "s13", "limit", "out_dtype")
    values = (x_data, x_scale, order, offsets, weights, w13, s13, LIMIT, torch.float32)
    return dict(zip(names, values, strict=True)) | change


def down_args(**change: object) -> dict[str, object]:
    _, _, ids, _, _, _, w2, s2 = moe_case(generator(1), 3, 2, 4, 64, 32, 32)
    h_data, h_scale = quant.fp8_quant(torch.randn(6, 32))
    offsets = kernels.moe_pairs(ids, 4)[1]
    names = ("h_data", "h_scale", "offsets", "w2", "s2", "out_dtype")
    return dict(zip(names, (h_data, h_scale, offsets, w2, s2, torch.float32), strict=True)) | change


U8 = torch.uint8


@pytest.mark.parametrize(
    ("op", "name", "change"),
    [
        (gate_up_args, "s13", {"s13": torch.zeros(4, 64, 8, dtype=U8)}),  # 8 inputs per scale: neither layout
        (down_args, "s2", {"s2": torch.zeros(4, 64, 4, dtype=U8)}),
        (gate_up_args, "x_data", {"x_data": torch.zeros(3, 64)}),
        (gate_up_args, "x_scale", {"x_scale": torch.zeros(3, 1, dtype=U8)}),
        (gate_up_args, "order", {"order": torch.zeros(6)}),
        (gate_up_args, "order", {"order": torch.zeros(6, dtype=torch.int32)}),
        (gate_up_args, "weights", {"weights": torch.zeros(5, 2)}),
        (gate_up_args, "offsets", {"offsets": torch.zeros(4, dtype=torch.int32)}),
        (gate_up_args, "w13", {"w13": torch.zeros(4, 63, 32, dtype=U8)}),  # W1 and W3 not stacked
        (gate_up_args, "w13", {"w13": torch.zeros(4, 64, 16, dtype=U8)}),
        (gate_up_args, "out_dtype", {"out_dtype": torch.int64}),
        (down_args, "h_data", {"h_data": torch.zeros(6, 40, dtype=U8)}),
        (down_args, "w2", {"w2": torch.zeros(4, 64, 32)}),
        (down_args, "offsets", {"offsets": torch.zeros(5)}),
        (down_args, "order", {"order": torch.zeros(6)}),
        (down_args, "order", {"order": torch.zeros(5, dtype=torch.int64)}),
    ],
)
def test_moe_gemms_name_a_bad_argument(op, name: str, change: dict[str, object]) -> None:
    fn = kernels.moe_gate_up if op is gate_up_args else kernels.moe_down
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=f"^{name}:"):
            fn(**op(**change), backend=backend)


def test_moe_pairs_names_a_bad_argument() -> None:
    with pytest.raises(ValueError, match=r"^ids:"):
        kernels.moe_pairs(torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match=r"^ids:"):
        kernels.moe_pairs(torch.zeros(3, 0, dtype=torch.int64), 4)


@pytest.mark.parametrize(
    ("tuning", "name"),
    [(MoEGemmTuning(block_n=16), "block_n"), (MoEGemmTuning(block_k=16), "block_k"),
     (MoEGemmTuning(block_m=24), "block_m"), (MoEGemmTuning(ptx=True), "ptx"), (MoEGemmTuning(dot="fp8"), "dot")],
)  # fmt: skip
def test_moe_gate_up_names_a_bad_launch_shape(tuning: MoEGemmTuning, name: str) -> None:
    """Tile sides must suit tl.arange and tl.dot (gate_up's 16 weight rows would be 8 output columns); the interpreter
    runs no inline PTX and no FP8 dot."""
    with pytest.raises(ValueError, match=f"tuning.{name}"):
        kernels.moe_gate_up(**gate_up_args(), backend="triton", tuning=tuning)


def test_chunked_code_dots_need_scales_per_32_inputs() -> None:
    """Per-chunk rescaling needs one weight scale per 32-input chunk: the 16-input layout is refused by name."""
    x_data, x_scale, ids, weights, w13, s13, _, _ = moe_case(generator(5), 3, 2, 4, 64, 32, 16)
    order, offsets = kernels.moe_pairs(ids, 4)
    args = (x_data, x_scale, order, offsets, weights, w13, s13, LIMIT, torch.float32)
    with pytest.raises(ValueError, match=r"tuning.dot: .* got 'fp32' \(per 16\)"):
        kernels.moe_gate_up(*args, backend="triton", tuning=MoEGemmTuning(dot="fp32"))
