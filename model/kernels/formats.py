"""Bit-exact E2M1 / E4M3 / UE8M0 codecs inside Triton kernels, the in-register twins of model/quant.py.

Everything is integer arithmetic on fp32 bit patterns (plus one exact fp32 rounding trick), so the kernels produce the
same bytes as the torch reference on the GPU and in the CPU interpreter alike, without relying on fp8 casts.
"""

import functools
import os

import torch
import triton
import triton.language as tl

E2M1_MAX = tl.constexpr(6.0)
E4M3_MAX = tl.constexpr(448.0)
RNE_MAGIC = tl.constexpr(8388608.0)  # 2^23: adding and subtracting it rounds a float in [0, 2^22) to an integer (RNE)


@triton.jit
def ceil_pow2(x):
    """2^ceil(log2 x) for positive normal fp32 x, from its bits; inf and NaN pass through."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = bits >> 23
    rounded = (exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23
    return tl.where(exponent >= 255, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def abs_bits(x):
    """|x| as int32 bits: ordered as the magnitudes are, every NaN above inf (so a max over them propagates NaN, as
    torch's amax does, where a float max would drop it)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def ue8m0_encode(scale):
    """Power-of-two fp32 → biased exponent byte (the fp32 exponent field)."""
    return ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)


@triton.jit
def ue8m0_decode(byte):
    """UE8M0 byte → 2^(e − 127) as fp32 (0 → 2^-127, 255 → NaN)."""
    e = byte.to(tl.int32)
    value = (e << 23).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, 5.877471754111438e-39, value)  # 2^-127, an fp32 subnormal
    return tl.where(e == 255, float("nan"), value)


@triton.jit
def e4m3_encode(x):
    """fp32 → E4M3 bits (uint8), round to nearest even, saturating at ±448, NaN → 0x7F | sign."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    magnitude = tl.minimum(tl.abs(x), E4M3_MAX)
    mbits = magnitude.to(tl.int32, bitcast=True)
    # normal range (≥ 2^-6): round the 23-bit mantissa to 3 bits (ties to even), then rebias the exponent 127 → 7
    rounded = (mbits + 0x7FFFF + ((mbits >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # subnormal range: code = RNE(|x| / 2^-9), which runs 0..8 (8 is the smallest normal, 2^-6)
    subnormal = ((magnitude * 512.0 + RNE_MAGIC) - RNE_MAGIC).to(tl.int32)
    code = tl.where(magnitude < 0.015625, subnormal, normal)
    code = tl.where(x != x, 0x7F, code)
    return code.to(tl.uint8) | sign


@triton.jit
def e4m3_decode(bits):
    """E4M3 bits (uint8) → fp32 (0x7F / 0xFF → NaN)."""
    b = bits.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m · 2^-9
    magnitude = tl.where((exponent == 15) & (mantissa == 7), float("nan"), magnitude)
    return (magnitude.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)  # keeps −0


@triton.jit
def e2m1_encode(q):
    """Scaled fp32 → E2M1 code (uint8 0..15): saturate to ±6, nearest, ties to the even code, sign kept."""
    a = tl.minimum(tl.abs(q), E2M1_MAX)
    bits = a.to(tl.int32, bitcast=True)
    # [1, 6]: round the fp32 mantissa to 1 bit (ties to even); exponent|mantissa then counts codes from 1.0 = code 2
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252
    # [0, 1): steps of 0.5, so the code is 2a rounded to an integer (ties to even: 0.25 → 0, 0.75 → 2)
    small = ((a * 2.0 + RNE_MAGIC) - RNE_MAGIC).to(tl.int32)
    code = tl.where(a < 1.0, small, normal)
    code = tl.where(q != q, 0, code)  # NaN → ±0, as the torch reference's comparisons give
    sign = (q.to(tl.int32, bitcast=True) >> 28) & 0x8
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_scaled(bits, scale, HW: tl.constexpr):
    """E4M3 bytes [R, W] and their decoded UE8M0 scales, one per 32 along W [R, W/32] → values [R, W], exactly (an
    E4M3 value times a power of two has ≤ 4 significant bits): bf16 by the hardware E4M3 cast (HW), else fp32 by
    the bit codec (the interpreter, which has no fp8 cast)."""
    R: tl.constexpr = bits.shape[0]
    W: tl.constexpr = bits.shape[1]
    codes = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) if HW else e4m3_decode(bits)
    values = tl.reshape(tl.reshape(codes, (R, W // 32, 32)) * scale[:, :, None], (R, W))
    return values.to(tl.bfloat16) if HW else values


@triton.jit
def ue8m0_block_scales(ptr, rows, ok, first, PER_ROW: tl.constexpr, COUNT: tl.constexpr, WORDS: tl.constexpr):
    """UE8M0 scales first … first + COUNT − 1 of `rows` ([*, PER_ROW] bytes) → fp32 [rows, COUNT]. WORDS: read as
    32-bit words (PER_ROW, COUNT and `first` multiples of 4): `cp.async` moves ≥ 4 bytes a thread, so a byte-wise
    load would stall every K tile instead of being pipelined. Masked scales read as byte 0 (2^-127): every caller
    masks its operand's bytes alike and zero-fills them, so they scale zeros; a zero fill is the copy's own, where
    any other value needs a select after the pipelined load (23 registers more in the grouped GEMM's loop)."""
    R: tl.constexpr = rows.shape[0]
    if WORDS:
        word = first // 4 + tl.arange(0, COUNT // 4)
        row_ptr = (ptr + rows * PER_ROW).to(tl.pointer_type(tl.int32))
        ok = ok[:, None] & (word < PER_ROW // 4)[None, :]
        words = tl.load(row_ptr[:, None] + word[None, :], mask=ok, other=0)
        shifts = 8 * tl.arange(0, 4)  # little-endian: scale 4w + j is byte j of word w
        scale_bytes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xFF, (R, COUNT))
    else:
        index = first + tl.arange(0, COUNT)
        ok = ok[:, None] & (index < PER_ROW)[None, :]
        scale_bytes = tl.load(ptr + rows[:, None] * PER_ROW + index[None, :], mask=ok, other=0)
    return ue8m0_decode(scale_bytes)


def scale_words(scale: torch.Tensor, per_row: int, per_tile: int) -> bool:
    """Whether `ue8m0_block_scales` may read these scales as 32-bit words: whole words per row and per K tile,
    4-byte aligned."""
    return per_row % 4 == 0 and per_tile % 4 == 0 and scale.data_ptr() % 4 == 0


# E2M1_CODE_BITS_PTX: e2m1_code_bits in nine fp32 instructions of the FMA pipe and two logic ops (explicit .rn: no
# contraction). `.sat` clamps to [0, 1] for free, which is what makes the grid's three slopes cheap.
E2M1_CODE_BITS_PTX = tl.constexpr(
    "{ .reg .f32 a, s1, s2, s3, i, t; .reg .b32 u; "
    "abs.f32 a, $1; "
    "mul.rn.sat.f32 s1, a, 0f3F000000; "  # sat(a/2): slope 2 on [0, 2] (× 4 below)
    "fma.rn.sat.f32 s2, a, 0f3F000000, 0fBF800000; "  # sat(a/2 − 1): slope 1 on [2, 4] (× 2)
    "fma.rn.sat.f32 s3, a, 0f3F000000, 0fC0000000; "  # sat(a/2 − 2): slope ½ on [4, 6]
    "fma.rn.f32 i, s2, 0f40000000, s3; "
    "fma.rn.f32 i, s1, 0f40800000, i; "  # index = 4·s1 + 2·s2 + s3
    "and.b32 u, $1, 0x80000000; or.b32 u, u, 0x3F800000; "  # ±1 by q's sign
    "fma.rn.f32 t, u, 0fC0800000, 0f45004000; "  # 2052 − 4·(±1)
    "add.rn.f32 t, i, t; "  # 2048 + index (+ 8 if negative), rounded to multiples of 2^-12
    "add.rn.f32 $0, t, 0f4AFFF000; }"  # + 2^23 − 2048: the nibble rounded to an integer (ties to even), low bits
)


@triton.jit
def e2m1_code_bits(q, PTX: tl.constexpr):
    """E2M1 code (sign included) of finite quotients q, in the low 4 bits of an int32 whose higher bits are
    0x4B00000 (a caller packing bytes truncates them away). Floating-point work where e2m1_encode spends integer
    shifts and a float → int conversion: the GPU issues fp32 operations at twice the integer rate.

    The E2M1 grid 0, ½, 1, 1½, 2, 3, 4, 6 is linear with slopes 2, 1 and ½ on [0, 2], [2, 4] and [4, 6], so
    index = 4·sat(a/2) + 2·sat(a/2 − 1) + sat(a/2 − 2) (sat: clamp to [0, 1]) sends grid point i to i, each
    midpoint to i + ½ and everything from 6 up to 7; rounding it to an integer, ties to even, is E2M1's round to
    nearest even. The sign adds 8 (even: ties unchanged). Before that last rounding, index is rounded to multiples of
    2^-12, which makes the result exact for a quotient within 2^-20 (relative) of an exact x / s that is either a
    rounding midpoint or ≥ 2^-10 index units from every one — as a bf16 x over an E4M3 or power-of-two s always is
    (x has 8 significant bits, a midpoint times s at most 7, so they differ by ≥ 2^-9 relative when they differ):
    the snap puts near-midpoints back on the midpoint and keeps every other value on its side.
    `PTX`: the GPU form (saturation for free); the interpreter runs the same arithmetic with clamps."""
    if PTX:
        return tl.inline_asm_elementwise(
            E2M1_CODE_BITS_PTX, "=r,r", [q.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=1
        )
    half = tl.abs(q) * 0.5
    index = 4.0 * tl.clamp(half, 0.0, 1.0) + 2.0 * tl.clamp(half - 1.0, 0.0, 1.0) + tl.clamp(half - 2.0, 0.0, 1.0)
    unit = ((q.to(tl.int32, bitcast=True) & -2147483648) | 0x3F800000).to(tl.float32, bitcast=True)  # ±1
    snapped = index + (2052.0 - 4.0 * unit)  # 2048 + index (+ 8 if negative), in multiples of 2^-12
    return (snapped + (RNE_MAGIC - 2048.0)).to(tl.int32, bitcast=True)


@triton.jit
def e2m1_to_f16(code):
    """E2M1 code → fp16 holding value · 2^-14 (exact; multiply by 2^14 after any fp16 product or cast).

    The magnitude bits land as exponent|mantissa of an fp16 with bias 15 instead of 1: codes 0–1 become fp16
    subnormals, 2–7 normals, all off by the same 2^-14.
    """
    c = code.to(tl.uint16)
    return (((c & 0x8) << 12) | ((c & 0x7) << 9)).to(tl.float16, bitcast=True)


# E2M1_BF16_PTX: four packed bytes ($4) and their scales as two bf16 pairs ($5: bytes 0, 1; $6: bytes 2, 3) → the
# low nibbles' values × scale ($0: bytes 0, 1; $1: bytes 2, 3) and the high nibbles' ($2, $3), as bf16 pairs. The
# magnitude nibbles index, by `prmt`, an 8-entry table of the low and of the high bytes of the bf16 magnitudes 0, ½,
# 1, 1½, 2, 3, 4, 6; two more `prmt`s interleave them into pairs and move each nibble's sign bit (bit 7 of a byte of
# $4 for the high nibble, of $4 << 4 for the low one) to bit 15 or 31; one bf16 FMA per pair scales (+ −0 keeps a −0).
E2M1_BF16_PTX = tl.constexpr(
    "{ .reg .b32 m, s, g, a, b, tl0, tl1, th0, th1, nz; "
    "mov.b32 tl0, 0xC0800000; mov.b32 tl1, 0xC0804000; "  # low bytes of the magnitudes 0 … 7
    "mov.b32 th0, 0x3F3F3F00; mov.b32 th1, 0x40404040; "  # high bytes
    "mov.b32 nz, 0x80008000; "
    "and.b32 m, $4, 0x77777777; shl.b32 s, $4, 4; "
    "prmt.b32 a, tl0, tl1, m; prmt.b32 b, th0, th1, m; "  # nibbles lo0 hi0 lo1 hi1
    "prmt.b32 $0, a, b, 0x6240; prmt.b32 g, s, $4, 0x1000; lop3.b32 $0, g, 0x80008000, $0, 0xEA; "
    "prmt.b32 $2, a, b, 0x7351; prmt.b32 g, s, $4, 0x5040; lop3.b32 $2, g, 0x80008000, $2, 0xEA; "
    "shr.b32 m, m, 16; "
    "prmt.b32 a, tl0, tl1, m; prmt.b32 b, th0, th1, m; "  # nibbles lo2 hi2 lo3 hi3
    "prmt.b32 $1, a, b, 0x6240; prmt.b32 g, s, $4, 0x3020; lop3.b32 $1, g, 0x80008000, $1, 0xEA; "
    "prmt.b32 $3, a, b, 0x7351; prmt.b32 g, s, $4, 0x7060; lop3.b32 $3, g, 0x80008000, $3, 0xEA; "
    "fma.rn.bf16x2 $0, $0, $5, nz; fma.rn.bf16x2 $1, $1, $6, nz; "
    "fma.rn.bf16x2 $2, $2, $5, nz; fma.rn.bf16x2 $3, $3, $6, nz; }"
)


# E2M1_E4M3_PTX: four packed bytes ($2) → the E4M3 bytes of their low nibbles ($0) and of their high nibbles ($1),
# four a register: each value × 2⁻⁶, exactly — sign to bit 7, the three magnitude bits to bits 4..2.
E2M1_E4M3_PTX = tl.constexpr(
    "{ .reg .b32 t; "
    "and.b32 t, $2, 0x08080808; shl.b32 t, t, 4; and.b32 $0, $2, 0x07070707; shl.b32 $0, $0, 2; or.b32 $0, $0, t; "
    "and.b32 t, $2, 0x70707070; shr.b32 t, t, 2; and.b32 $1, $2, 0x80808080; or.b32 $1, $1, t; }"
)


@triton.jit
def e2m1_as_e4m3(packed, PTX: tl.constexpr):
    """Packed E2M1 bytes → (E4M3 byte of the low nibble, of the high nibble): each value × 2⁻⁶, exactly (sign |
    magnitude << 2). `PTX` (GPU): four bytes per instruction sequence (E2M1_E4M3_PTX), else one value at a time."""
    if PTX:
        low, high = tl.inline_asm_elementwise(
            E2M1_E4M3_PTX, "=r,=r,r", [packed], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4
        )
    else:
        bits = packed.to(tl.int32)
        low = (((bits & 0x8) << 4) | ((bits & 0x7) << 2)).to(tl.uint8)
        high = ((bits & 0x80) | ((bits & 0x70) >> 2)).to(tl.uint8)
    return low, high


@triton.jit
def e2m1_scaled(packed, scale, PTX: tl.constexpr):
    """Packed E2M1 bytes and a power-of-two scale per byte → (value of the low nibble, value of the high nibble),
    each times the scale: exact (E2M1 values have two significant bits). `PTX` (GPU): bf16 by table lookups
    (E2M1_BF16_PTX: ≈ 3 instructions a value on sm_90, where the arithmetic below compiles to ≈ 8; the scale must be
    bf16 there); otherwise fp32 by `e2m1_to_f16`, the 2^14 folded into the scale."""
    if PTX:
        low, high = tl.inline_asm_elementwise(
            E2M1_BF16_PTX, "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
            pack=4,
        )  # fmt: skip
    else:
        scale = scale.to(tl.float32) * 16384.0
        low, high = e2m1_to_f16(packed & 0xF).to(tl.float32) * scale, e2m1_to_f16(packed >> 4).to(tl.float32) * scale
    return low, high


@triton.jit
def e2m1_decode(code):
    """E2M1 code → fp32 value."""
    return e2m1_to_f16(code).to(tl.float32) * 16384.0


def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """t [B, N, X] as a kernel reads it: each batch row dense (strides X, 1), any stride between rows.

    The packed cache hands kernels `[:, :n]` views of buffers with room for more entries; those are not contiguous
    when B > 1, and `.contiguous()` would copy the whole compressed KV on every layer of every step."""
    if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]:
        return t
    return t.contiguous()


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t with a dense last dimension, any strides before it: a column view of a wider GEMM's output stays a view (a
    kernel reads its rows by their stride), anything else is copied dense."""
    return t if t.stride(-1) == 1 else t.contiguous()


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (where low-precision tl.dot is unreliable: kernels dot in fp32)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def multiprocessors() -> int:
    """Streaming multiprocessors of the current GPU (1 without one: the interpreter runs programs one by one)."""
    if not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@functools.cache
def fp8_tensor_cores() -> bool:
    """Asked once, not on every layer of every step: whether the GPU's tensor cores take FP8 (sm_89 and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def check_tile_sides(**sides: tuple[int, int]) -> None:
    """Launch tile sides, name=(value, least), as tl.arange and tl.dot take them: powers of two ≥ least (a dot's
    sides ≥ 16); the error names the tuning field."""
    for name, (value, least) in sides.items():
        if value < least or value & (value - 1):
            raise ValueError(f"tuning.{name}: expected a power of two ≥ {least}, got {value}")
