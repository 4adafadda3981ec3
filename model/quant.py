"""Exact reference quantisers of DeepSeek-V4.1 (model-architecture.md §2.10, §6).

Three block formats, all computed in fp32 whatever the input dtype:

| format            | element     | block | scale                                   | used for                 |
|-------------------|-------------|-------|-----------------------------------------|--------------------------|
| FP8               | E4M3 (RNE)  | 32    | UE8M0, 2^ceil(log2(max(amax,1e-4)/448)) | SWA ring, linear inputs  |
| FP4 + E4M3 scale  | E2M1 (RNE)  | 16    | E4M3 RNE cast of max(amax, 6·2^-9)/6    | main (compressed) KV     |
| FP4 + UE8M0 scale | E2M1 (RNE)  | 32    | UE8M0, 2^ceil(log2(max(amax,6·2^-126)/6)) | indexer q/K, experts   |

Stored forms are plain uint8 tensors: E4M3 bit patterns, UE8M0 biased exponents, and E2M1 codes packed two
per byte with the lower-indexed element in the low nibble (the FlashMLA / checkpoint order). Every function is
pure torch and device-agnostic; the Triton kernels in `model.kernels` reproduce these bytes exactly.
"""

import torch
from torch import Tensor

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # the scale never drops below the smallest E4M3 subnormal
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # the scale never drops below the smallest normal fp32

# code → value; codes 8..15 are the negatives of 0..7 (8 is −0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)
# Midpoints between neighbouring E2M1 magnitudes. A tie goes to the even code: at 0.25, 1.25, 2.5 and 5 the lower
# neighbour's code is even (round down: the comparison is strict), at 0.75, 1.75 and 3.5 the upper one is.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_SUBNORMAL_LIFT = 64  # 2^64 moves every positive fp32 subnormal into the normal range, exactly


def check_block(x: Tensor, block: int, what: str) -> int:
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"{what}: last dimension must be a multiple of block={block}, got shape {tuple(x.shape)}")
    return x.shape[-1] // block


def _check_uint8(t: Tensor, what: str) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8, got {t.dtype}")


def _ceil_pow2_normal(x: Tensor) -> Tensor:
    """`ceil_pow2` of fp32 x that is 0, a positive normal, inf or NaN, in few ops (it sets every quantiser scale).

    Adding the mantissa mask carries into the exponent unless the mantissa is 0 (a power of two) and clearing the
    mantissa leaves that power; the largest finite floats carry into inf, and inf stays inf. A NaN's bits carry into
    the sign instead: it never compares ≥, so it passes through as itself.
    """
    up = ((x.view(torch.int32) + _MANTISSA_MASK) & ~_MANTISSA_MASK).view(torch.float32)
    return torch.where(up >= x, up, x)


def ceil_pow2(x: Tensor) -> Tensor:
    """2^ceil(log2 x) for positive fp32 x, read off the fp32 bits (float log2 is off by one at exact powers of 2).

    A power of two maps to itself; anything else to the next power up (above 2^127 that is inf). Subnormals are
    lifted into the normal range by an exact power-of-two product and brought back. x = 0 gives 0; inf and NaN
    pass through.
    """
    x = x.float()
    subnormal = x < torch.finfo(torch.float32).tiny
    lifted = _ceil_pow2_normal(torch.where(subnormal, x * 2.0**_SUBNORMAL_LIFT, x))
    return torch.where(subnormal, lifted * 2.0**-_SUBNORMAL_LIFT, lifted)


def ue8m0_encode(scale: Tensor) -> Tensor:
    """Power-of-two scale 2^k (k = −127..127) → biased exponent byte k + 127; NaN/inf → 255 (the UE8M0 NaN).

    The byte is the fp32 exponent field, which is exactly log2(scale) + 127 for a power of two (2^-127, an fp32
    subnormal, has field 0 = its UE8M0 code).
    """
    bits = scale.float().view(torch.int32)
    return ((bits >> _MANTISSA_BITS) & 0xFF).to(torch.uint8)


def ue8m0_decode(byte: Tensor) -> Tensor:
    """UE8M0 byte e → 2^(e − 127) as fp32; 255 → NaN."""
    _check_uint8(byte, "ue8m0 byte")
    e = byte.to(torch.int32)
    value = (e << _MANTISSA_BITS).view(torch.float32)
    value = torch.where(e == 0, torch.full_like(value, 2.0**-127), value)
    return torch.where(e == 255, torch.full_like(value, float("nan")), value)


def _to_e4m3(x: Tensor) -> Tensor:
    """fp32 → float8_e4m3fn, round-to-nearest-even, saturating at ±448."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_encode(x: Tensor) -> Tensor:
    """fp32 → E4M3 (float8_e4m3fn) bits, round-to-nearest-even, saturating at ±448."""
    return _to_e4m3(x).view(torch.uint8)


def e4m3_decode(bits: Tensor) -> Tensor:
    """E4M3 bits → fp32 (0x7F / 0xFF are NaN)."""
    _check_uint8(bits, "e4m3 bits")
    return bits.view(torch.float8_e4m3fn).float()


def e2m1_encode(q: Tensor) -> Tensor:
    """Scaled fp32 values → E2M1 codes (uint8 0..15): saturate to ±6, round to nearest, ties to the even code.

    The sign bit is kept, so small negatives become code 8 (−0), as a hardware cvt does.
    """
    a = q.float().abs().clamp(max=E2M1_MAX)
    magnitude = torch.zeros_like(a, dtype=torch.uint8)
    for midpoint, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_ROUNDS_UP, strict=True):
        magnitude += (a >= midpoint) if tie_up else (a > midpoint)
    return magnitude | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """E2M1 codes (uint8 0..15) → fp32 values.

    Arithmetic instead of a lookup in E2M1_VALUES, so no host table is copied to the device (nor into a CUDA
    graph): the magnitude bits become exponent|mantissa of an fp16 with bias 15 instead of 1 (codes 0–1 land on
    fp16 subnormals), i.e. the value times 2^-14, exactly.
    """
    _check_uint8(codes, "e2m1 codes")
    c = codes.to(torch.int32)
    half = (((c & 0x8) << 12) | ((c & 0x7) << 9)).to(torch.int16)  # 0x8000 wraps to the int16 sign bit
    return half.view(torch.float16).float() * 2.0**14


def pack_fp4(codes: Tensor) -> Tensor:
    """uint8 codes [..., D] → bytes [..., D/2]; element 2i in the low nibble, 2i+1 in the high nibble."""
    _check_uint8(codes, "fp4 codes")
    check_block(codes, 2, "pack_fp4")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """bytes [..., D/2] → uint8 codes [..., D] (inverse of pack_fp4)."""
    _check_uint8(packed, "packed fp4")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _blocks(x: Tensor, block: int) -> Tensor:
    """[..., D] → fp32 [..., D/block, block]."""
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def _block_amax(xb: Tensor, floor: float) -> Tensor:
    # not linalg.vector_norm(ord=inf), one op fewer: the same value, but 16× slower on the CPU from a few hundred rows
    return xb.abs().amax(dim=-1, keepdim=True).clamp_min(floor)


def _fp8_scale(xb: Tensor) -> Tensor:
    """Block scales [..., D/block, 1] of fp32 blocks: powers of two, each ≥ 2^-22 (the amax floor keeps them normal)."""
    return _ceil_pow2_normal(_block_amax(xb, FP8_AMAX_FLOOR) / E4M3_MAX)


def fp8_quant(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """x [..., D] → (E4M3 bits uint8 [..., D], UE8M0 scales uint8 [..., D/block])."""
    check_block(x, block, "fp8_quant")
    xb = _blocks(x, block)
    scale = _fp8_scale(xb)
    data = e4m3_encode(xb / scale).flatten(-2)
    return data, ue8m0_encode(scale.squeeze(-1))


def fp8_dequant(data: Tensor, scale: Tensor, block: int = 32, dtype: torch.dtype = torch.float32) -> Tensor:
    """(E4M3 bits [..., D], UE8M0 scales [..., D/block]) → values [..., D] in dtype."""
    check_scale_shape(data, scale, block, 1, "fp8_dequant")
    values = _blocks(e4m3_decode(data), block) * ue8m0_decode(scale).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def _fp4_codes(xb: Tensor, scale: Tensor) -> Tensor:
    return pack_fp4(e2m1_encode(xb / scale).flatten(-2))


def fp4_quant_e4m3(x: Tensor, block: int = 16) -> tuple[Tensor, Tensor]:
    """Main-KV format: x [..., D] → (packed E2M1 uint8 [..., D/2], E4M3 scale bits uint8 [..., D/block])."""
    check_block(x, block, "fp4_quant_e4m3")
    xb = _blocks(x, block)
    scale_bits = e4m3_encode(_block_amax(xb, FP4_E4M3_AMAX_FLOOR) / E2M1_MAX)
    return _fp4_codes(xb, e4m3_decode(scale_bits)), scale_bits.squeeze(-1)


def fp4_quant_ue8m0(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Indexer / expert format: x [..., D] → (packed E2M1 uint8 [..., D/2], UE8M0 scales uint8 [..., D/block])."""
    check_block(x, block, "fp4_quant_ue8m0")
    xb = _blocks(x, block)
    scale = _ceil_pow2_normal(_block_amax(xb, FP4_UE8M0_AMAX_FLOOR) / E2M1_MAX)  # the floor keeps it normal
    return _fp4_codes(xb, scale), ue8m0_encode(scale.squeeze(-1))


def check_scale_shape(data: Tensor, scale: Tensor, block: int, elements_per_byte: int, what: str) -> None:
    _check_uint8(data, f"{what} data")
    _check_uint8(scale, f"{what} scale")
    elements = data.shape[-1] * elements_per_byte
    if elements % block != 0 or scale.shape != (*data.shape[:-1], elements // block):
        raise ValueError(
            f"{what}: scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)} "
            f"({elements} elements per row, block={block})"
        )


def _fp4_dequant(packed: Tensor, scale_values: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    values = _blocks(e2m1_decode(unpack_fp4(packed)), block) * scale_values.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def fp4_dequant_e4m3(packed: Tensor, scale: Tensor, block: int = 16, dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed E2M1 [..., D/2], E4M3 scale bits [..., D/block]) → values [..., D] in dtype."""
    check_scale_shape(packed, scale, block, 2, "fp4_dequant_e4m3")
    return _fp4_dequant(packed, e4m3_decode(scale), block, dtype)


def fp4_dequant_ue8m0(packed: Tensor, scale: Tensor, block: int = 32, dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed E2M1 [..., D/2], UE8M0 scales [..., D/block]) → values [..., D] in dtype."""
    check_scale_shape(packed, scale, block, 2, "fp4_dequant_ue8m0")
    return _fp4_dequant(packed, ue8m0_decode(scale), block, dtype)


def straight_through(x: Tensor, q: Tensor) -> Tensor:
    """QAT: the value q with x's gradient (identity)."""
    # x − x.detach() is exactly 0 with gradient 1, so the value is q (x + (q − x) would round); without a gradient
    # to carry, q itself (adding that 0 turns a −0 into +0 and costs an op per layer and step when serving)
    return q + (x - x.detach()) if x.requires_grad and torch.is_grad_enabled() else q


def fake_quant_fp8(x: Tensor, block: int = 32) -> Tensor:
    """QAT: dequant(fp8_quant(x)) in x's dtype, gradient straight through.

    Computed without the stored bytes (every linear layer's input passes here, on every serving step): the scale is
    a normal power of two (its amax floor keeps it ≥ 2^-22), which UE8M0 encodes and decodes unchanged, and E4M3
    bits decode to the value the fp8 tensor holds, so this is the byte round trip's value bit for bit."""
    check_block(x, block, "fake_quant_fp8")
    xb = _blocks(x.detach(), block)
    scale = _fp8_scale(xb)
    q = _to_e4m3(xb / scale).float() * scale
    return straight_through(x, q.flatten(-2).to(x.dtype))


def fake_quant_fp4_e4m3(x: Tensor, block: int = 16) -> Tensor:
    """QAT: dequant(fp4_quant_e4m3(x)) in x's dtype, gradient straight through."""
    return straight_through(x, fp4_dequant_e4m3(*fp4_quant_e4m3(x.detach(), block), block, x.dtype))


def fake_quant_bf16(x: Tensor) -> Tensor:
    """x rounded to bf16 (RNE) in x's dtype, gradient straight through (the unquantised-KV baseline)."""
    return straight_through(x, x.detach().to(torch.bfloat16).to(x.dtype))


def fake_quant_fp4_ue8m0(x: Tensor, block: int = 32) -> Tensor:
    """QAT: dequant(fp4_quant_ue8m0(x)) in x's dtype, gradient straight through."""
    return straight_through(x, fp4_dequant_ue8m0(*fp4_quant_ue8m0(x.detach(), block), block, x.dtype))
