"""model/quant.py against hand-computed tables (model-architecture.md §2.10, §6) and format error bounds."""

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.quant import (
    E2M1_VALUES,
    ceil_pow2,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    fake_quant_fp4_e4m3,
    fake_quant_fp4_ue8m0,
    fake_quant_fp8,
    fp4_dequant_e4m3,
    fp4_dequant_ue8m0,
    fp4_quant_e4m3,
    fp4_quant_ue8m0,
    fp8_dequant,
    fp8_quant,
    pack_fp4,
    ue8m0_decode,
    ue8m0_encode,
    unpack_fp4,
)

F32 = torch.float32


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F32)


def u8(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def next_up(x: float) -> float:
    return torch.nextafter(f32(x), f32(math.inf)).item()


def next_down(x: float) -> float:
    return torch.nextafter(f32(x), f32(-math.inf)).item()


# ---------------------------------------------------------------- E2M1


def test_e2m1_table() -> None:
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E2M1_VALUES.tolist() == magnitudes + [-m for m in magnitudes]
    assert torch.signbit(E2M1_VALUES[8])  # code 8 is −0, not +0


def test_e2m1_every_code_decodes_to_the_table() -> None:
    decoded = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(decoded.view(torch.int32), E2M1_VALUES.view(torch.int32))  # bit for bit: code 8 is −0


def test_e2m1_every_code_encodes_to_itself() -> None:
    assert e2m1_encode(E2M1_VALUES).tolist() == list(range(16))


# (tie, code just below it): a tie goes to the even code — 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4
E2M1_MIDPOINTS = [(0.25, 0), (0.75, 1), (1.25, 2), (1.75, 3), (2.5, 4), (3.5, 5), (5.0, 6)]


@pytest.mark.parametrize(("tie", "lower"), E2M1_MIDPOINTS)
def test_e2m1_ties_to_even_and_neighbours(tie: float, lower: int) -> None:
    even = lower if lower % 2 == 0 else lower + 1
    got = e2m1_encode(f32(tie, next_down(tie), next_up(tie), -tie, -next_down(tie), -next_up(tie))).tolist()
    assert got == [even, lower, lower + 1, even | 8, lower | 8, (lower + 1) | 8]


def test_e2m1_saturates_and_keeps_sign() -> None:
    got = e2m1_encode(f32(6.0, 6.5, 100.0, math.inf, -7.0, -math.inf, -0.1, -0.0, 0.1)).tolist()
    assert got == [7, 7, 7, 7, 15, 15, 8, 8, 0]


# ---------------------------------------------------------------- ceil_pow2


def test_ceil_pow2_exact_at_every_power_of_two() -> None:
    exponents = torch.arange(-149, 128, dtype=torch.float64)
    powers = torch.exp2(exponents).float()
    assert torch.equal(ceil_pow2(powers), powers)
    above = torch.nextafter(powers[:-1], f32(math.inf))
    assert torch.equal(ceil_pow2(above), powers[1:])
    below = torch.nextafter(powers[2:], f32(0.0))  # (the float below 2^-148 is 2^-149, itself a power)
    assert torch.equal(ceil_pow2(below), powers[2:])


def test_ceil_pow2_table() -> None:
    got = ceil_pow2(f32(3.0, 0.3, 448.0, 449.0, 1e-4 / 448, 0.0, math.inf, next_up(2.0**127)))
    assert got.tolist() == [4.0, 0.5, 512.0, 512.0, 2.0**-22, 0.0, math.inf, math.inf]
    assert ceil_pow2(f32(math.nan)).isnan().all()


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=0.0, max_value=2.0**127, width=32, allow_subnormal=True, exclude_min=True))
def test_ceil_pow2_matches_frexp(x: float) -> None:
    mantissa, exponent = math.frexp(x)  # exact in float64; x = mantissa · 2^exponent, mantissa ∈ [0.5, 1)
    expected = 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent
    assert ceil_pow2(f32(x)).item() == _fp32(expected)


# ---------------------------------------------------------------- UE8M0


def test_ue8m0_every_byte() -> None:
    decoded = ue8m0_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert decoded[:255].tolist() == [math.ldexp(1.0, e - 127) for e in range(255)]
    assert decoded[255].isnan()
    assert ue8m0_encode(decoded).tolist() == list(range(256))


def test_ue8m0_encode_table() -> None:
    assert ue8m0_encode(f32(1.0, 2.0, 0.5, 2.0**-127, 2.0**127, math.inf, math.nan)).tolist() == [
        127, 128, 126, 0, 254, 255, 255,
    ]  # fmt: skip


# ---------------------------------------------------------------- E4M3


def _e4m3_value(bits: int) -> float:
    sign = -1.0 if bits & 0x80 else 1.0
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa * 2.0**-9
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_e4m3_every_code() -> None:
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = e4m3_decode(bits)
    for b in range(256):
        expected = _e4m3_value(b)
        assert (math.isnan(expected) and decoded[b].isnan()) or decoded[b].item() == expected, b
    finite = ~decoded.isnan()
    # every finite code round-trips, except −0 staying −0 (0x80) — both zeros keep their sign
    assert torch.equal(e4m3_encode(decoded[finite]), bits[finite])


E4M3_TABLE = [
    (1.0, 0x38), (0.5, 0x30), (448.0, 0x7E), (447.0, 0x7E), (500.0, 0x7E), (math.inf, 0x7E), (-448.0, 0xFE),
    (-1e6, 0xFE), (2.0**-9, 0x01), (2.0**-10, 0x00),  # tie between 0 and the smallest subnormal → 0 (even)
    (3 * 2.0**-10, 0x02),  # tie between codes 1 and 2 → 2
    (2.0**-6, 0x08), (17.0, 0x58),  # tie 16 | 18 → 16 (even mantissa)
    (19.0, 0x5A),  # tie 18 | 20 → 20
    (240.0, 0x77), (256.0, 0x78), (-0.0, 0x80),
]  # fmt: skip


@pytest.mark.parametrize(("value", "bits"), E4M3_TABLE)
def test_e4m3_rounding_and_saturation(value: float, bits: int) -> None:
    assert e4m3_encode(f32(value)).item() == bits


# ---------------------------------------------------------------- pack / unpack


def test_pack_nibble_order() -> None:
    assert pack_fp4(u8(1, 2, 0xF, 0x0, 0x0, 0xA)).tolist() == [0x21, 0x0F, 0xA0]
    assert unpack_fp4(u8(0x21, 0x0F, 0xA0)).tolist() == [1, 2, 0xF, 0x0, 0x0, 0xA]


def test_pack_roundtrip_random() -> None:
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)


# ---------------------------------------------------------------- FP8 block quantiser


def test_fp8_scale_edges() -> None:
    x = torch.zeros(5, 32)
    x[0, 3] = 448.0  # amax/448 = 1 exactly → scale 1
    x[1, 3] = 449.0  # just above → scale 2
    x[2, 3] = -448.0 * 2.0**-20  # a power of two stays
    # row 3 is all zero: amax floor 1e-4 → 2^ceil(log2(1e-4/448)) = 2^-22
    x[4, 0], x[4, 1] = 3.0, -1.0  # amax 3 → 3/448 → 2^-7
    data, scale = fp8_quant(x)
    assert scale.tolist() == [[127], [128], [107], [105], [120]]
    assert data[0, 3].item() == 0x7E
    assert data[1, 3].item() == 0x76
    assert data[2, 3].item() == 0xFE
    assert data[3].eq(0).all()
    assert data[4, :2].tolist() == [0x7C, 0xF0]  # 3/2^-7 = 384 = 1.5·2^8, −1/2^-7 = −128 = −2^7
    assert fp8_dequant(data, scale)[4, :2].tolist() == [384.0 * 2.0**-7, -128.0 * 2.0**-7]


def test_fp8_roundtrip_of_representable_values_is_exact() -> None:
    codes = torch.randint(0, 0x7F, (4, 64), dtype=torch.uint8)
    codes[:, 0] = 0x7E  # pin the block amax to 448 · 2^k so the scale is exactly 2^k
    codes[:, 32] = 0x7E
    values = e4m3_decode(codes) * 2.0**-5
    data, scale = fp8_quant(values)
    assert torch.equal(data, codes)
    assert scale.eq(127 - 5).all()
    assert torch.equal(fp8_dequant(data, scale), values)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
def test_fp8_error_bound(seed: int, magnitude: float) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)) * magnitude
    data, scale = fp8_quant(x)
    y = fp8_dequant(data, scale)
    s = ue8m0_decode(scale).repeat_interleave(32, dim=-1)
    # E4M3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normals, absolute ≤ 2^-10·s in the subnormal range
    assert ((y - x).abs() <= torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)).all()


# ---------------------------------------------------------------- FP4 quantisers


def test_fp4_e4m3_hand_block() -> None:
    row = f32(6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0, -0.3, 0.0, 4.0, -1.5, 0.5, 3.0, 1.0)
    packed, scale = fp4_quant_e4m3(row)
    codes = [7, 0, 2, 2, 4, 4, 6, 6, 15, 9, 0, 6, 11, 1, 5, 2]
    assert scale.tolist() == [0x38]  # amax 6 → scale 1.0
    assert unpack_fp4(packed).tolist() == codes
    assert packed.tolist() == [codes[i] | codes[i + 1] << 4 for i in range(0, 16, 2)]
    assert fp4_dequant_e4m3(packed, scale).tolist() == E2M1_VALUES[codes].tolist()


def test_fp4_e4m3_scale_edges() -> None:
    x = torch.zeros(4, 16)
    x[0, 0] = 7.0  # 7/6 = 1.1667 → E4M3 RNE 1.125 (0x39); 7/1.125 = 6.2 saturates to code 7
    x[1, 0] = 6 * 448.0 * 4  # scale saturates at 448
    # row 2 all zero: amax floor 6·2^-9 → scale 2^-9 (the smallest subnormal E4M3, 0x01)
    x[3, 0] = -1.5 * 6  # 9/6 = 1.5 exactly
    packed, scale = fp4_quant_e4m3(x)
    assert scale.squeeze(-1).tolist() == [0x39, 0x7E, 0x01, 0x3C]
    assert unpack_fp4(packed)[:, 0].tolist() == [7, 7, 0, 15]
    assert fp4_dequant_e4m3(packed, scale)[:, 0].tolist() == [6.75, 2688.0, 0.0, -9.0]


def test_fp4_ue8m0_scale_edges() -> None:
    x = torch.zeros(4, 32)
    x[0, 0] = 6.0  # → 2^0
    x[1, 0] = 6.01  # → 2^1
    # row 2 all zero: floor 6·2^-126 → 2^-126 (byte 1)
    x[3, 0], x[3, 1] = 12.0, 1.0  # 12/6 = 2 exactly; 1/2 = 0.5 → code 1
    packed, scale = fp4_quant_ue8m0(x)
    assert scale.squeeze(-1).tolist() == [127, 128, 1, 128]
    assert unpack_fp4(packed)[:, :2].tolist() == [[7, 0], [5, 0], [0, 0], [7, 1]]  # 6.01/2 = 3.005 → 3 (code 5)


@pytest.mark.parametrize(
    ("quantise", "dequantise", "block"),
    [(fp4_quant_e4m3, fp4_dequant_e4m3, 16), (fp4_quant_ue8m0, fp4_dequant_ue8m0, 32)],
)
def test_fp4_error_bound(quantise, dequantise, block: int) -> None:
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(block)) * 3
    packed, scale = quantise(x)
    y = dequantise(packed, scale)
    amax = x.abs().unflatten(-1, (-1, block)).amax(-1, keepdim=True)
    # E2M1 steps are ≤ 2 scale units, so rounding (and the ≤ 6·2^-4 units of saturation an E4M3 scale rounded down
    # allows) errs by ≤ 1 unit; a unit is < 2·amax/6 (UE8M0 rounds up by < 2×, E4M3 RNE by ≤ 1+2^-4)
    bound = (amax / 6 * 2).expand(-1, -1, block).flatten(-2)
    assert ((y - x).abs() <= bound).all()
    assert ((y - x).abs() > 0).any()  # it does quantise


def test_packed_sizes_of_the_released_formats() -> None:
    kv, kv_scale = fp4_quant_e4m3(torch.randn(512))
    idx, idx_scale = fp4_quant_ue8m0(torch.randn(128))
    swa, swa_scale = fp8_quant(torch.randn(512))
    assert kv.numel() + kv_scale.numel() == 288
    assert idx.numel() + idx_scale.numel() == 68
    assert swa.numel() + swa_scale.numel() == 528


# ---------------------------------------------------------------- fake quant (QAT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("fake", "quantise", "dequantise"),
    [
        (fake_quant_fp8, fp8_quant, fp8_dequant),
        (fake_quant_fp4_e4m3, fp4_quant_e4m3, fp4_dequant_e4m3),
        (fake_quant_fp4_ue8m0, fp4_quant_ue8m0, fp4_dequant_ue8m0),
    ],
)
def test_fake_quant_value_and_straight_through_gradient(fake, quantise, dequantise, dtype: torch.dtype) -> None:
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(7)) * 5).to(dtype).requires_grad_()
    y = fake(x)
    assert y.dtype == dtype
    assert torch.equal(y.detach(), dequantise(*quantise(x.detach()), dtype=dtype))
    assert not torch.equal(y.detach(), x.detach())
    weights = torch.randn(3, 64).to(dtype)
    (y * weights).sum().backward()
    assert torch.equal(x.grad, weights)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quant_fp8_is_the_byte_round_trip_on_special_values(dtype: torch.dtype) -> None:
    """fake_quant_fp8 skips the bytes; on every kind of block it must still give the round trip's bits: E4M3 ties,
    the amax floor, subnormal-scaled values, ±0, saturation, ±inf and NaN blocks, and magnitudes 2^-40 … 2^40."""
    g = torch.Generator().manual_seed(3)
    ties = torch.tensor([0.0, -0.0, 1.0625, 1.1875, 448.0, 464.0, 2.0**-9, 3 * 2.0**-10, 1e-6, 6e-5, 17.0, 0.25])
    x = torch.cat([ties[torch.randint(0, len(ties), (8, 32), generator=g)], torch.randn(24, 32, generator=g)])
    x = x * 2.0 ** torch.randint(-40, 40, (32, 1), generator=g)
    x[3, 5], x[4, 0], x[5, 9] = float("inf"), float("-inf"), float("nan")
    x = x.reshape(8, 128).to(dtype)
    got = fake_quant_fp8(x)
    want = fp8_dequant(*fp8_quant(x), dtype=dtype)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(got.isnan(), want.isnan())  # NaN blocks: NaN whatever its sign and payload
    assert torch.equal(got.nan_to_num(0.0).view(bits), want.nan_to_num(0.0).view(bits))  # ±0 and the rest, bit for bit


# ---------------------------------------------------------------- bad input


def test_bad_shapes_and_dtypes_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of block=32"):
        fp8_quant(torch.randn(4, 48))
    with pytest.raises(ValueError, match="multiple of block=16"):
        fp4_quant_e4m3(torch.randn(4, 40))
    with pytest.raises(ValueError, match="scale shape"):
        fp4_dequant_e4m3(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        fp8_dequant(torch.zeros(4, 32), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of block=2"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
