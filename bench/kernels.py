"""Kernel benchmarks and checks at real sizes (issue 4): ours (Triton) beside the torch peers, in one run.

    python bench/kernels.py --check                        # the CPU tests' checks at real sizes; exit 1 on a failure
    python bench/kernels.py --bench all                    # every section, then the table, JSON and plots
    python bench/kernels.py --bench topk,attention-1 --parts DIR   # some sections, each writing DIR/<section>.json
    python bench/kernels.py --report --parts DIR           # merge DIR/*.json: table (stdout), kernels.json, PNGs
    python bench/kernels.py --check --bench all --isolated --deadline 300   # one process per item (the GPU run)
    python bench/kernels.py --tiny --check --bench all     # smoke run of this script on CPU (Triton interpreter)

A CUDA fault (an illegal address) poisons the process's context, so a GPU run starts one process per section
(`--isolated`: the checks, then each section, each under a time limit, none started after `--deadline` seconds)
and merges them with `--report`; a section rewrites its JSON after every row, so a stopped one keeps its rows.

For each kernel: median time (CUDA-graph replay), effective bandwidth = bytes it must move / time, that as a % of
the device-to-device copy bandwidth (section `copy`), and the speed-up over the torch peer measured in the same
process. The `step-*` sections time a whole `small`-preset decode step against a dense-attention model of the same
size (`decode_step_bench`); `topk-model` times the top-k on the scores such a step really produces (ties, −inf
outside the candidate pool, padded rows); the `tune-*` sections compare launch shapes, each checked against the
default's output.

Imports only torch, triton, numpy, matplotlib and the standard library besides the model (the GPU image has
nothing else).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton

from model import DecodeBatch, build_model, kernels, preset, quant
from model.cache import Entries
from model.engram_store import DeviceMemory
from model.graphs import MIN_CONTEXT, StepGraphs
from model.kernels import fp8_gemm, hc_mixes, indexer, kv_quant, sparse_attn, topk

GiB = 1 << 30
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------- timing


def median_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn, replayed from a CUDA graph (launch gaps out of the figure); host timer on CPU."""
    if not torch.cuda.is_available():
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    except Exception:  # an op that cannot be captured (host sync inside): plain event timing
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def wall_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median wall-clock milliseconds of fn (synchronised) after two warm-up calls: for code with host syncs."""
    times = []
    for i in range(repeat + 2):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@dataclass
class Row:
    kernel: str
    shape: str
    ours_ms: float | None
    peer: str
    peer_ms: float | None
    bytes_moved: int
    params: dict[str, int] = field(default_factory=dict)  # the shape as numbers (plots)
    extra: dict[str, float] = field(default_factory=dict)

    def bandwidth(self) -> float | None:
        return self.bytes_moved / (self.ours_ms * 1e-3) if self.ours_ms and self.bytes_moved else None


# ----------------------------------------------------------------------------------------------- inputs


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def random_ints(low: int, high: int, *shape: int) -> torch.Tensor:
    """Uniform uint8 values in [low, high), drawn a leading row at a time: torch's CUDA random kernels fault on a
    draw of 2^32 elements (B=64 × 256 K packed entries)."""
    out = torch.empty(shape, dtype=torch.uint8, device=DEVICE)
    for row in out.view(shape[0], -1):
        row.random_(low, high)
    return out


def random_bytes(*shape: int) -> torch.Tensor:
    return random_ints(0, 256, *shape)  # every byte is two valid E2M1 codes


def valid_e4m3(*shape: int) -> torch.Tensor:
    """E4M3 bytes of magnitude 2^-3 … 2^2 with random signs (no NaN): scales, or FP8 ring values."""
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device=DEVICE) << 7
    return torch.randint(0x20, 0x48, shape, dtype=torch.uint8, device=DEVICE) | sign


def valid_e4m3_scales(*shape: int) -> torch.Tensor:
    return random_ints(0x20, 0x48, *shape)


def valid_ue8m0_scales(*shape: int) -> torch.Tensor:
    return random_ints(122, 131, *shape)


def indexer_inputs(B: int, T: int, H: int, Di: int, S: int, ragged: bool) -> tuple[torch.Tensor, ...]:
    q_data, q_scale = kernels.quantize_index_fp4(randn(B, T, H, Di), backend="triton")
    k_data, k_scale = kernels.quantize_index_fp4(randn(B, S, Di) * 0.3, backend="triton")
    weights = randn(B, T, H)
    n_visible = torch.randint(0, S + 1, (B, T), device=DEVICE) if ragged else torch.full((B, T), S, device=DEVICE)
    return q_data, q_scale, weights, k_data, k_scale, n_visible


def attention_inputs(B: int, T: int, H: int, D: int, W: int, N: int, K: int, ragged: bool) -> tuple:
    q = randn(B, T, H, D, dtype=torch.bfloat16)
    swa_data, swa_scale = kernels.quantize_swa_fp8(randn(B, W, D), backend="triton")
    swa_idx = torch.arange(W, device=DEVICE, dtype=torch.int32).expand(B, T, W)
    swa_idx = torch.where(torch.rand(B, T, W, device=DEVICE) < (0.8 if ragged else 2.0), swa_idx, -1)
    kv_data, kv_scale = random_bytes(B, N, D // 2), valid_e4m3_scales(B, N, D // 16)
    idx = torch.randint(0, N, (B, T, K), device=DEVICE, dtype=torch.int32)  # repeats allowed: the kernel may see any
    if ragged:
        idx = torch.where(torch.rand(B, T, K, device=DEVICE) < 0.1, -1, idx)
    sink = randn(H)
    R = W - min(T, W)  # window slots < R: the ring's; the rest: the step's new keys
    ring, new = (swa_data[:, :R], swa_scale[:, :R]), (swa_data[:, R:], swa_scale[:, R:])
    return q, *ring, *new, swa_idx, kv_data, kv_scale, idx, sink, D**-0.5


def fp8_linear_inputs(M: int, N: int, K: int) -> tuple[torch.Tensor, ...]:
    """FP8 activations [M, K] (the QAT cast of Gaussian rows) and an FP8 weight [N, K] with 32 × 32 block scales."""
    x_data, x_scale = kernels.quantize_swa_fp8(randn(M, K), backend="triton")
    w = valid_e4m3(N, K).view(torch.float8_e4m3fn)
    return x_data, x_scale, w, valid_ue8m0_scales(triton.cdiv(N, 32), K // 32)


def expert_scales(*shape: int) -> torch.Tensor:
    """UE8M0 expert-weight scales 2^-8 … 2^-5: with E2M1 codes, weights of the size that keeps x·W ≈ 1 at C = 5120, so
    that the SwiGLU clamps (10) rarely bite and the checks see the products themselves."""
    return torch.randint(119, 123, shape, dtype=torch.uint8, device=DEVICE)


@dataclass
class MoEInputs:
    """One routed-expert layer: FP8 tokens, top-k routing sorted into pairs, packed E2M1 experts (w13, w2)."""

    x_data: torch.Tensor
    x_scale: torch.Tensor
    ids: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor

    def gate_up(self, backend: str, dtype: torch.dtype = torch.bfloat16, fp8: bool = False, **tuning: object):
        """h [P, I] in dtype, or (`fp8`) its FP8 (bytes, scales) as moe_down reads them."""
        args = (self.x_data, self.x_scale, self.order, self.offsets, self.weights, self.w13, self.s13)
        gemm = kernels.moe_gate_up_cast if fp8 else kernels.moe_gate_up
        return gemm(*args, SWIGLU_LIMIT, dtype, backend=backend,
                    tuning=kernels.MoEGemmTuning(**tuning) if tuning else None)  # fmt: skip

    def down(self, h: tuple[torch.Tensor, torch.Tensor], backend: str, dtype: torch.dtype = torch.bfloat16,
             **tuning: object) -> torch.Tensor:  # fmt: skip
        """h: the FP8 (bytes, scales) of gate_up's output."""
        return kernels.moe_down(*h, self.offsets, self.w2, self.s2, dtype, backend=backend,
                                tuning=kernels.MoEGemmTuning(**tuning) if tuning else None)  # fmt: skip

    def weight_bytes(self) -> tuple[int, int]:
        """Bytes of the packed weights and scales of the experts with pairs: (w13 + s13, w2 + s2)."""
        active = int((self.offsets[1:] > self.offsets[:-1]).sum())
        per_expert = [(w[0].numel() + s[0].numel()) for w, s in ((self.w13, self.s13), (self.w2, self.s2))]
        return active * per_expert[0], active * per_expert[1]


SWIGLU_LIMIT = 10.0


def expert_weights(E: int, C: int, I: int, block: int) -> tuple[torch.Tensor, ...]:
    """Packed E2M1 experts: w13 [E, 2I, C/2], s13, w2 [E, C, I/2], s2 (UE8M0 per `block` inputs)."""
    return (random_bytes(E, 2 * I, C // 2), expert_scales(E, 2 * I, C // block), random_bytes(E, C, I // 2),
            expert_scales(E, C, I // block))  # fmt: skip


def moe_inputs(weights: tuple[torch.Tensor, ...], N: int, top: int) -> MoEInputs:
    """N tokens routed uniformly at random to `top` distinct experts each, over the given expert weights."""
    E, C = weights[0].shape[0], weights[0].shape[2] * 2
    x_data, x_scale = kernels.quantize_swa_fp8(randn(N, C), backend="triton")
    ids = torch.rand(N, E, device=DEVICE).argsort(dim=-1)[:, :top]
    order, offsets = kernels.moe_pairs(ids, E)
    return MoEInputs(x_data, x_scale, ids, order, offsets, torch.rand(N, top, device=DEVICE), *weights)


# ----------------------------------------------------------------------------------------------- peers


def candidate_mask_topk(scores: torch.Tensor, n_visible: torch.Tensor, block_size: int, topk_blocks: int):
    """The natural torch form of the candidate pool: block maxima by reshape + amax, newest block pinned,
    torch.topk, scatter, expand (ties broken as torch.topk likes; the checks compare it on tie-free scores)."""
    S = scores.shape[-1]
    positions = torch.arange(S, device=scores.device)
    visible = scores.float().masked_fill(positions >= n_visible[..., None], float("-inf"))
    blocks = F.pad(visible, (0, -S % block_size), value=float("-inf")).unflatten(-1, (-1, block_size)).amax(-1)
    newest = ((n_visible.long() - 1).clamp(min=0) // block_size)[..., None]
    blocks.scatter_(-1, newest, torch.where(n_visible[..., None] > 0, float("inf"), blocks.gather(-1, newest)))
    values, picked = blocks.topk(min(topk_blocks, blocks.shape[-1]), dim=-1)
    kept = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, picked, values > float("-inf"))
    return kept.repeat_interleave(block_size, dim=-1)[..., :S] & (positions < n_visible[..., None])


# ----------------------------------------------------------------------------------------------- checks


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def run(self, check: Callable[..., None], *args: object) -> None:
        """One check; an exception (a kernel that fails to compile, say) is a failure, not the end of the run."""
        try:
            check(self, *args)
        except Exception as error:  # report and go on: one GPU call should bring back every result
            detail = f"raised {type(error).__name__}: {error} (cause: {error.__cause__!r})"
            self.report(f"{check.__name__}{args}", False, detail[-3000:])

    def report(self, name: str, ok: bool, detail: str) -> None:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        if not ok:
            self.failures.append(name)


def exact_rounding_rows(rows: int) -> torch.Tensor:
    """bf16 rows where an FP4 quantiser's rounding is most likely to slip: every finite bf16 value (shuffled into
    blocks, so each meets random block maxima), then blocks of E2M1 rounding midpoints times odd E4M3 scales (1.125,
    1.75, …; each block's maximum 6 × its scale), ties that a reciprocal multiply must land exactly."""
    every = torch.arange(-32768, 32768, dtype=torch.int32, device=DEVICE).to(torch.int16).view(torch.bfloat16)
    every = every[every.isfinite()]
    shuffled = torch.cat(
        [every[torch.randperm(len(every), device=DEVICE)] for _ in range(2 * max(1, rows // 512))]
    )  # 2 × 65,280 = 255 rows
    scales = quant.e4m3_decode(torch.randint(40, 120, (rows, 32, 1), dtype=torch.uint8, device=DEVICE))
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], device=DEVICE)
    ties = midpoints[torch.randint(0, len(midpoints), (rows, 32, 16), device=DEVICE)] * scales
    ties[..., 0] = 6.0 * scales[..., 0]
    ties *= torch.where(torch.rand(ties.shape, device=DEVICE) < 0.5, -1.0, 1.0)
    return torch.cat([shuffled.reshape(-1, 512), ties.reshape(rows, 512).to(torch.bfloat16)])


def check_quantisers(c: Checks, rows: int) -> None:
    magnitudes = 2.0 ** torch.randint(-30, 30, (rows, 1), device=DEVICE).float()
    inputs = []
    for dtype in (torch.bfloat16, torch.float32):
        x = (randn(rows, 512) * magnitudes).to(dtype)
        x[: rows // 8] = quant.E2M1_VALUES.to(DEVICE)[torch.randint(0, 16, (rows // 8, 512), device=DEVICE)] * 0.5
        inputs.append((str(dtype), x))
    inputs.append(("bf16 every value + odd-scale ties", exact_rounding_rows(rows)))
    for name, x in inputs:
        for fmt in ("kv_fp4", "index_fp4", "swa_fp8"):
            want = getattr(kernels, f"quantize_{fmt}")(x, backend="torch")
            got = getattr(kernels, f"quantize_{fmt}")(x, backend="triton")
            bad = sum(int((g != w).sum()) for g, w in zip(got, want, strict=True))
            back_t = getattr(kernels, f"dequantize_{fmt}")(*want, torch.bfloat16, backend="torch")
            back = getattr(kernels, f"dequantize_{fmt}")(*want, torch.bfloat16, backend="triton")
            bad_back = int((back.view(torch.int16) != back_t.view(torch.int16)).sum())
            c.report(f"quantise {fmt} {name}", bad == 0 and bad_back == 0, f"{len(x)}×512, {bad} bytes differ, "
                     f"{bad_back} dequantised values differ")  # fmt: skip
    # the window latent's cast with its RoPE in the launch: the RoPE kernel's output cast, bit for bit
    x = randn(rows, 512, dtype=torch.bfloat16)
    rope = (torch.randint(0, 1 << 20, (rows,), device=DEVICE), 10000.0 ** -(torch.arange(0, 64, 2.0) / 64).double())
    fused = kernels.quantize_swa_fp8(x, "triton", rope)
    apart = kernels.quantize_swa_fp8(kernels.rope_rotate(x, *rope, inverse=False, backend="triton"), "triton")
    bad = sum(int((f != a).sum()) for f, a in zip(fused, apart, strict=True))
    c.report("quantise swa_fp8 with RoPE", bad == 0, f"{rows}×512, {bad} bytes differ from RoPE, then the cast")
    # and with kv_norm before the RoPE: the norm kernel's rows, rotated by the RoPE kernel, then cast
    norm = ((torch.rand(512, device=DEVICE) + 0.5).bfloat16(), 1e-6)
    fused = kernels.quantize_swa_fp8(x, "triton", rope, norm)
    normed = kernels.norm_cast(x, None, *norm, backend="triton")[0]
    apart = kernels.quantize_swa_fp8(kernels.rope_rotate(normed, *rope, inverse=False, backend="triton"), "triton")
    bad = sum(int((f != a).sum()) for f, a in zip(fused, apart, strict=True))
    c.report("quantise swa_fp8 with norm and RoPE", bad == 0, f"{rows}×512, {bad} bytes differ from the norm, RoPE, "
             "then the cast")  # fmt: skip


def check_activations(c: Checks, rows: int) -> None:
    """The per-step activation kernels: the FP8 QAT cast bit for bit, a site's norm within two bf16 ulps and its cast
    bit for bit, the shared expert's SwiGLU cast within an E4M3 step, the mHC coefficients within fp32 rounding (with
    the update before them: its X' within a bf16 ulp), the MoE routing's experts exactly (ties included) and its
    weights within fp32 rounding, RoPE within a bf16 ulp."""
    from model import mhc
    from model.activation import swiglu

    x = (randn(rows, 4096) * 2.0 ** torch.randint(-20, 20, (rows, 1), device=DEVICE).float()).to(torch.bfloat16)
    want = kernels.fake_quant_fp8(x, backend="torch")
    bad = int((kernels.fake_quant_fp8(x, backend="triton").view(torch.int16) != want.view(torch.int16)).sum())
    c.report("fake_quant_fp8 bf16", bad == 0, f"{rows}×4096, {bad} values differ")
    X, fn = randn(rows, 4, 1024, dtype=torch.bfloat16) * 4.0, randn(24, 4096) / 64.0
    pre, weight = torch.rand(rows, 4, device=DEVICE) + 0.2, (torch.rand(1024, device=DEVICE) + 0.5).bfloat16()
    (x, data, scale), (want_x, _, _) = (
        kernels.norm_cast(X, pre, weight, 1e-6, backend=be) for be in ("triton", "torch")
    )
    # two bf16 ulps: the collapse's sum may round the other way, then the norm's (Triton's interpreter truncates);
    # plus 2^-14 where the collapse cancels to near 0 (its fp32 sums in another order, normed values are O(1))
    off = int(((x.float() - want_x.float()).abs() > want_x.float().abs() * 2.0**-6 + 2.0**-14).sum())
    bad = sum(int((a != b).sum()) for a, b in zip((data, scale), quant.fp8_quant(x, 32), strict=True))
    c.report("norm_cast n=4 C=1024", off == 0 and bad == 0,
             f"{rows} rows, {off} values off by more than two bf16 ulps, {bad} cast bytes differ")  # fmt: skip
    # h may round otherwise than the compiled SwiGLU's (and the interpreter truncates): its values within an E4M3 step
    gate, up = (randn(rows, 2 * 2048, dtype=torch.bfloat16) * 4.0).split(2048, dim=1)
    got, want = kernels.swiglu_cast(gate, up, 10.0, backend="triton"), quant.fp8_quant(swiglu(gate, up, 10.0), 32)
    differ = int((got[0] != want[0]).sum()) + int((got[1] != want[1]).sum())
    error = (quant.fp8_dequant(*got) - quant.fp8_dequant(*want)).abs()
    off = int((error > quant.fp8_dequant(*want).abs() * 2.0**-3 + 2.0**-12).sum())
    c.report("swiglu_cast I=2048", off == 0, f"{rows} rows, {differ} bytes differ from the compiled SwiGLU's cast, "
             f"{off} values more than an E4M3 step off")  # fmt: skip
    case = (X, fn, torch.rand(3, device=DEVICE) + 0.5, randn(24))
    got = kernels.hc_coefficients(*case, 4, 20, 1e-6, 1e-6, backend="triton")
    want = mhc.hc_split_sinkhorn(mhc.hc_mixes(X, fn, 1e-6), *case[2:], 4, 20, 1e-6)
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    c.report("hc_coefficients n=4 C=1024", worst < 1e-4, f"{rows} rows, worst |Δ| {worst:.2e} (values ≤ 2)")
    out, post, comb = randn(rows, 1024, dtype=torch.bfloat16), got[1], got[2]  # the site's update, its mixes
    fused = kernels.hc_expand_coefficients(out, *case[:1], post, comb, *case[1:], 4, 20, 1e-6, 1e-6, backend="triton")
    apart = mhc.hc_expand(out, X, post, comb).float()
    off = int(((fused[0].float() - apart).abs() > apart.abs() * 2.0**-7 + 2.0**-14).sum())
    again = kernels.hc_coefficients(fused[0], *case[1:], 4, 20, 1e-6, 1e-6, backend="triton")
    same = all(torch.equal(a, b) for a, b in zip(fused[1:], again, strict=True))
    c.report("hc_expand_coefficients n=4 C=1024", off == 0 and same, f"{rows} rows, {off} of X' off by more than a "
             f"bf16 ulp, coefficients {'' if same else 'not '}those of the X' returned")  # fmt: skip
    x, gate, bias = randn(rows, 4096, dtype=torch.bfloat16), randn(384, 4096) / 64.0, randn(384) * 0.1
    gate[192:] = gate[:192]  # tied scores
    (got_w, got_ids), (_, want_ids) = (kernels.moe_route(x, gate, bias, 6, True, 2.5, backend=be)
                                       for be in ("triton", "torch"))  # fmt: skip
    # judged in fp64: a chosen expert may fall short of the 6th best biased score by fp32 rounding only
    scores = torch.nn.functional.softplus(x.double() @ gate.double().T).sqrt()
    biased = scores + bias.double()
    short = float((biased.topk(6, dim=1).values[:, 5] - biased.gather(1, got_ids).min(1).values).max())
    exact = scores.gather(1, got_ids)
    worst = float((got_w.double() - exact / exact.sum(1, keepdim=True) * 2.5).abs().max())
    differ, ascending = int((got_ids != want_ids).any(1).sum()), bool((got_ids.diff(dim=1) > 0).all())
    detail = f"{rows} rows ({differ} choose otherwise than torch's fp32), a chosen expert at most {short:.2e} short "
    detail += f"of the 6th best, worst weight |Δ| {worst:.2e} (fp64), ids {'' if ascending else 'not '}ascending"
    c.report("moe_route E=384 k=6", ascending and short <= 1e-5 and worst < 1e-5, detail)
    x = randn(rows, 8, 512, dtype=torch.bfloat16)
    positions = torch.randint(0, 1 << 20, (rows,), device=DEVICE)
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64, device=DEVICE) / 64))
    # one bf16 ulp of the result, plus 8 fp32 ulps of the row's inputs where the two products cancel (the kernel may
    # fuse one into an FMA: one rounding fewer)
    inputs = x.float().abs()[..., 448:].amax(-1, keepdim=True)
    for inverse in (False, True):
        got, want = (kernels.rope_rotate(x, positions, inv_freq, inverse, backend=be) for be in ("triton", "torch"))
        error = (got.float() - want.float()).abs()
        off = int((error > want.float().abs() * 2.0**-7 + inputs * 2.0**-20).sum())
        c.report(f"rope_rotate bf16 inverse={inverse}", off == 0 and torch.equal(got[..., :448], x[..., :448]),
                 f"{rows}×8×512, positions < 2^20, {off} values off, worst |Δ| {float(error.max()):.2e}")  # fmt: skip


def check_indexer(c: Checks, B: int, T: int, S: int, spread: int | None = None, room: int = 0) -> None:
    """With `spread`, batch row 0's queries hold one channel block 2^-spread below their others (the kernel folds
    spreads ≤ 14 into its FP8 query operand and rescales wider ones block by block), the last query a NaN scale,
    and two K entries the scales the quantiser never writes (2^-127, NaN: their programs decode scales in full).
    `room`: K read in place from buffers with room for that many more entries per row, as from the cache (rows of a
    multiple of 4 entries: bytes and scales by TMA; otherwise the scale rows are off TMA's 16-byte pitch)."""
    case = list(indexer_inputs(B, T, 32, 128, S, ragged=True))
    if spread is not None:
        case[1] = torch.full_like(case[1], 150)
        case[1][0, :, :, 1] = 150 - spread
        case[1][-1, -1, 0, 0] = 255
        case[4][0, 3, 1], case[4][-1, S // 2, 2] = 0, 255
    want = kernels.indexer_scores(*case, backend="torch")
    views = list(case)
    for i in (3, 4):
        views[i] = torch.cat([case[i], case[i].new_zeros(B, room, case[i].shape[2])], dim=1)[:, :S]
    got = kernels.indexer_scores(*views, backend="triton")
    q = quant.fp4_dequant_ue8m0(*case[:2])
    k = quant.fp4_dequant_ue8m0(*case[3:5])
    bound = torch.einsum("bth,bths->bts", case[2].abs(), torch.einsum("bthd,bsd->bths", q, k).abs()) * 2.0**-20
    finite = torch.isfinite(want)
    same_mask = bool(torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got.isnan(), want.isnan()))
    excess = float(((got - want).abs() - bound)[finite].max()) if finite.any() else 0.0
    c.report(
        f"indexer B={B} T={T} S={S}"
        + ("" if spread is None else f" spread={spread}")
        + (f" room={room}" if room else ""),
        same_mask and excess <= 0,
        f"inf/NaN masks equal {same_mask}, worst excess {excess:.2e}",
    )


def check_candidates(c: Checks, B: int, T: int, S: int, topk_blocks: int) -> None:
    scores = randn(B, T, S)
    n_visible = torch.randint(1, S + 1, (B, T), device=DEVICE)
    n_visible[0, 0] = S
    want = kernels.candidate_mask(scores, n_visible, 8, topk_blocks, backend="torch")
    got = kernels.candidate_mask(scores, n_visible, 8, topk_blocks, backend="triton")
    peer = candidate_mask_topk(scores, n_visible, 8, topk_blocks)  # the benchmark's peer computes the same mask
    c.report(f"candidate_mask B={B} T={T} S={S}", bool(torch.equal(got, want)) and bool(torch.equal(peer, want)),
             f"{int((got != want).sum())} differ, torch.topk peer: {int((peer != want).sum())} differ")  # fmt: skip


def topk_is_valid(scores: torch.Tensor, lengths: torch.Tensor, k: int, got: torch.Tensor) -> tuple[bool, str]:
    """Vectorised form of the CPU tests' check: the right count, ascending distinct positions then −1, and the
    multiset of chosen scores equal to torch.topk's."""
    R, L = scores.shape
    valid = topk.selectable(scores, lengths)
    masked = torch.where(valid, scores.float(), float("-inf"))
    best = masked.topk(min(k, L), dim=-1).values
    count = torch.minimum(valid.sum(-1), torch.tensor(k, device=DEVICE))
    slot = torch.arange(k, device=DEVICE)
    used = slot < count[:, None]
    ok_pad = bool(((got == -1) == ~used).all())
    pos = got.long().clamp(min=0)
    inside = bool(((pos < lengths[:, None]) | ~used).all())
    ascending = bool(((got[:, 1:] > got[:, :-1]) | ~used[:, 1:]).all())
    picked = torch.where(used, masked.gather(1, pos), float("-inf")).sort(dim=-1, descending=True).values
    want = torch.full((R, k), float("-inf"), device=DEVICE)
    want[:, : best.shape[1]] = torch.where(slot[: best.shape[1]] < count[:, None], best, float("-inf"))
    same = bool(torch.equal(picked, want))
    return ok_pad and inside and ascending and same, f"padding {ok_pad}, in range {inside}, ascending {ascending}, " \
        f"top values {same}"  # fmt: skip


def check_topk(c: Checks, shapes: list[tuple[int, int, int]]) -> None:
    for R, L, k in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            scores = randn(R, L, dtype=dtype)
            scores[:, :: max(1, L // 97)] = float("-inf")
            lengths = torch.randint(0, L + 1, (R,), device=DEVICE)
            lengths[0] = L
            got = kernels.topk_indices(scores, k, lengths, backend="triton")
            ok, detail = topk_is_valid(scores, lengths, k, got)
            if dtype == torch.float32:  # no ties: the very indices of the reference
                same = bool(torch.equal(got, kernels.topk_indices(scores, k, lengths, backend="torch")))
                ok, detail = ok and same, f"{detail}, equal to reference {same}"
            c.report(f"topk R={R} L={L} k={k} {dtype}", ok, detail)
    R, L, k = shapes[-1]
    full = torch.full((R,), L, device=DEVICE)
    trend = torch.arange(L, device=DEVICE).float() / L + 0.01 * randn(R, L)  # the best at the end: k·group candidates
    got = kernels.topk_indices(trend, k, None, backend="triton")
    same = bool(torch.equal(got, kernels.topk_indices(trend, k, None, backend="torch")))
    c.report(f"topk trending rows R={R} L={L} k={k}", same, f"equal to reference {same}")
    ties = torch.randint(0, 3, (R, L), device=DEVICE).to(torch.bfloat16)  # a third of each row ties at the top
    got = kernels.topk_indices(ties, k, None, backend="triton")
    ok, detail = topk_is_valid(ties, full, k, got)
    positions = torch.arange(L, device=DEVICE, dtype=torch.float64)
    ranked = (ties.double() * 4 * L - positions).topk(k, dim=-1).indices  # exact: value first, then lowest position
    lowest = bool(torch.equal(got, ranked.sort(dim=-1).values.int()))
    c.report(f"topk ties R={R} L={L} k={k}", ok and lowest, f"{detail}, lowest positions {lowest}")


def check_attention(c: Checks, B: int, T: int, N: int) -> None:
    case = attention_inputs(B, T, 64, 512, 128, N, 512, ragged=True)
    want = kernels.sparse_attention(*case, backend="torch").float()
    got = kernels.sparse_attention(*case, backend="triton").float()
    rel = float((got - want).norm() / want.norm())
    # bf16 dots: the latents are exact in bf16, P is rounded to bf16 (2^-9 relative) before P·V
    c.report(
        f"sparse_attention B={B} T={T} N={N}", rel < 1e-2 and bool(torch.isfinite(got).all()), f"rel err {rel:.1e}"
    )
    # RoPE on q and RoPE⁻¹ on the output inside the kernel: the RoPE kernel's results around it, bit for bit
    q, *rest = case
    positions = torch.randint(0, 1 << 20, (B, T), device=DEVICE)
    rope = (positions, 10000.0 ** -(torch.arange(0, 64, 2, dtype=torch.float64) / 64))  # the model's 64 dims
    fused = kernels.sparse_attention(q, *rest, backend="triton", rope=rope)
    rotated = kernels.rope_rotate(q, *rope, inverse=False, backend="triton")
    apart = kernels.rope_rotate(kernels.sparse_attention(rotated, *rest, backend="triton"), *rope, inverse=True,
                                backend="triton")  # fmt: skip
    differ = int((fused != apart).sum())
    c.report(f"sparse_attention with RoPE B={B} T={T} N={N}", differ == 0, f"{differ} elements differ from apart")


def check_fp8_linear(c: Checks, M: int, N: int, K: int, tuning: dict[str, object] | None = None) -> None:
    """Triton against the reference in fp32 and bf16. FP8 tensor cores add a chunk's 32 exact products with fewer
    bits than fp32 (≈ 14, DeepSeek-V3 measured on Hopper); each chunk is promoted to fp32 at once, so each output is
    off by ≈ 2^-14 of its chunks' absolute sums, summed randomly: ≈ 3·10^-4 of the output's norm at K = 5120 —
    ‖Δ‖/‖ref‖ < 2·10^-3 leaves room, and one wrong chunk scale (1 of 160) or 32-row block moves it by percents.
    bf16 outputs add their rounding (2^-9): 10^-2. `fp8_linear_cast` (float activations, cast inside the GEMM below
    32 tokens) must give the bits of the cast kernel's bytes through the GEMM."""
    case = fp8_linear_inputs(M, N, K)
    want = kernels.fp8_linear(*case, torch.float32, backend="torch")
    t = kernels.FP8GemmTuning(**(tuning or {}))
    for dtype, tolerance in ((torch.float32, 2e-3), (torch.bfloat16, 1e-2)):
        got = kernels.fp8_linear(*case, dtype, backend="triton", tuning=t)
        rel = float((got.float() - want).norm() / want.norm())
        ok = got.dtype == dtype and rel < tolerance and bool(torch.isfinite(got).all())
        c.report(f"fp8_linear M={M} N={N} K={K} {dtype} {tuning or ''}", ok, f"rel err {rel:.1e}")
        x = randn(M, K).to(dtype)
        cast = kernels.quantize_swa_fp8(x, backend="triton")
        ok = torch.equal(kernels.fp8_linear_cast(x, *case[2:], backend="triton", tuning=t),
                         kernels.fp8_linear(*cast, *case[2:], dtype, backend="triton", tuning=t))  # fmt: skip
        c.report(f"fp8_linear_cast M={M} N={N} K={K} {dtype} {tuning or ''}", ok, "bits of cast + GEMM")


def check_moe_gemm(
    c: Checks, E: int, C: int, I: int, block: int, tokens: list[int], tuning: dict[str, object] | None = None
) -> None:
    """Both grouped GEMMs against their references (top-6), in fp32 and bf16. The operands are exact in bf16 and the
    dots accumulate in fp32, so in fp32 only the summation order differs (≈ 2^-24 · √K relative): ‖Δ‖/‖ref‖ < 10^-4
    leaves 100× that; a wrong expert, scale block or input order moves it by tens of percents. bf16 outputs add
    their rounding (2^-9): 10^-2."""
    weights = expert_weights(E, C, I, block)
    tuning = tuning or {}
    for N in tokens:
        m = moe_inputs(weights, N, 6)
        want = m.gate_up("torch", torch.float32)
        h = kernels.quantize_swa_fp8(want, backend="triton")
        want_out = m.down(h, "torch", torch.float32)
        for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
            for name, got, ref in (("gate_up", m.gate_up("triton", dtype, **tuning), want),
                                   ("down", m.down(h, "triton", dtype, **tuning), want_out)):  # fmt: skip
                rel = float((got.float() - ref).norm() / ref.norm())
                ok = got.dtype == dtype and rel < tolerance and bool(torch.isfinite(got).all())
                c.report(f"moe {name} E={E} tokens={N} block {block} {dtype} {tuning or ''}", ok, f"rel err {rel:.1e}")
        # the pairs counted into place in one launch: torch's sort and search, exactly
        counted = kernels.moe_pairs(m.ids, E, "triton")
        same = all(map(torch.equal, counted, (m.order, m.offsets)))
        c.report(f"moe pairs E={E} tokens={N}", same, f"order and offsets equal to torch's {same}")
        # gate_up's output cast to FP8 in its epilogue: the cast kernel's bytes of its bf16 output
        cast = m.gate_up("triton", torch.bfloat16, True, **{"cast": True, **tuning})
        apart = kernels.quantize_swa_fp8(m.gate_up("triton", torch.bfloat16, **tuning), "triton")
        bad = sum(int((a != b).sum()) for a, b in zip(cast, apart, strict=True))
        c.report(f"moe gate_up cast E={E} tokens={N} block {block} {tuning or ''}", bad == 0, f"{bad} bytes differ")


def check_row_gather(c: Checks, rows: int, ids: int) -> None:
    """Rows gathered from a table in page-locked host memory (on a GPU: read in place over PCIe) — E4M3 Engram rows,
    their UE8M0 scales, bf16 rows — bit for bit the rows indexed on the host, the table's last row included."""
    pin = DEVICE == "cuda"
    for name, width, dtype in (("E4M3 rows × 256", 256, torch.uint8), ("UE8M0 scales × 8", 8, torch.uint8),
                               ("bf16 rows × 64", 64, torch.bfloat16)):  # fmt: skip
        table = torch.randint(0, 256, (rows, width * dtype.itemsize), dtype=torch.uint8).view(dtype)
        table = table.pin_memory() if pin else table
        index = torch.randint(0, rows, (ids,), device=DEVICE)
        index[0] = rows - 1
        out = torch.empty((ids, width), dtype=dtype, device=DEVICE)
        kernels.gather_rows(table, index, out, backend="triton")
        want = table[index.cpu()]
        bad = int((out.cpu().view(torch.uint8) != want.view(torch.uint8)).sum())
        c.report(f"row gather {name}", bad == 0, f"{ids} of {rows} rows{' (pinned host table)' if pin else ''}, "
                 f"{bad} bytes differ")  # fmt: skip


def run_checks(names: list[str], tiny: bool) -> list[str]:
    """The checks of the named kernels (`all`: every one) at real sizes (`tiny`: CPU sizes)."""
    print("checks (Triton against the torch references)", flush=True)
    if tiny:
        plans = {"quant": [(check_quantisers, 16)], "activations": [(check_activations, 8)],
                 "indexer": [(check_indexer, 2, 3, 100), (check_indexer, 2, 2, 50, 120),
                             (check_indexer, 2, 1, 90, None, 13)],
                 "candidates": [(check_candidates, 1, 2, 200, 4)], "topk": [(check_topk, [(3, 300, 8)])],
                 "attention": [(check_attention, 1, 2, 100)],
                 "fp8-gemm": [(check_fp8_linear, 3, 40, 128), (check_fp8_linear, 1, 64, 256),
                              (check_fp8_linear, 40, 64, 256)],
                 "moe-gemm": [(check_moe_gemm, 8, 128, 64, 32, [1, 3]),
                              (check_moe_gemm, 8, 128, 64, 16, [3]),
                              (check_moe_gemm, 8, 128, 64, 32, [3], {"dot": "fp32"})],
                 "row-gather": [(check_row_gather, 50, 37)]}  # fmt: skip
    else:
        plans = {"quant": [(check_quantisers, 1 << 16)], "activations": [(check_activations, 1 << 14)],
                 "indexer": [(check_indexer, 8, 1, 70_001), (check_indexer, 1, 300, 20_000),
                             (check_indexer, 2, 1, 5_000, 14), (check_indexer, 2, 3, 5_000, 15),
                             (check_indexer, 4, 1, 65_536, None, 16), (check_indexer, 4, 1, 65_531, None, 14)],
                 "candidates": [(check_candidates, 4, 2, 200_003, 2048)],
                 "topk": [(check_topk, [(1, 4096, 512), (256, 65_536, 512), (6, 1_000_000, 512), (3, 300_000, 2048),
                                        (2, 20_000_000, 512), (64, 131_072, 512), (256, 262_144, 512)])],
                 "attention": [(check_attention, 4, 2, 50_000), (check_attention, 2, 1, 1_000_000),
                               (check_attention, 1, 1, 1_048_576)],
                 "fp8-gemm": [(check_fp8_linear, M, N, K) for M in (1, 64, 256)
                              for N, K in ((1280, 5120), (32768, 1280), (5120, 8192))]
                             + [(check_fp8_linear, 64, 1280, 5120, {"dot": "fp32"}),
                                (check_fp8_linear, 64, 1280, 5120, {"dot": "fp8"}),
                                (check_fp8_linear, 1, 5120, 8192, {"dot": "bf16"}),
                                (check_fp8_linear, 256, 5120, 8192, {"split_k": 4})],
                 "moe-gemm": [(check_moe_gemm, E, 5120, 2304, block, [1, 64, 256])
                              for E in (48, 384) for block in (32, 16)]
                             + [(check_moe_gemm, 48, 5120, 2304, 32, [64], {"ptx": False})]
                             + [(check_moe_gemm, E, 5120, 2304, 32, [1, 64, 256], {"dot": "fp8"})
                                for E in (48, 384)],
                 "row-gather": [(check_row_gather, 10_000_000, 64 * 7 * 24), (check_row_gather, 1000, 1)]}  # fmt: skip
    c = Checks()
    for name in plans if names == ["all"] else names:
        for check, *args in plans[name]:
            c.run(check, *args)
    return c.failures


# ----------------------------------------------------------------------------------------------- kernel sections


def bench_copy(tiny: bool) -> Iterator[Row]:
    """Device-to-device copy of fp32 (16-byte vector accesses): the bandwidth ceiling of the % copy column."""
    nbytes = 1 << 20 if tiny else 2 * GiB
    src = randn(nbytes // 4)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    yield Row("copy", f"{nbytes / GiB:.2f} GiB fp32", ms, "", None, 2 * nbytes)


def bench_quantisers(tiny: bool) -> Iterator[Row]:
    rows = 64 if tiny else 1 << 20
    x = randn(rows, 512, dtype=torch.bfloat16)
    shape = f"{rows}×512 bf16 ({x.numel() * 2 / GiB:.2f} GiB)"
    for fmt, out_bytes in (("kv_fp4", 288), ("index_fp4", 256 + 16), ("swa_fp8", 528)):
        fn = getattr(kernels, f"quantize_{fmt}")
        ours = median_ms(lambda fn=fn: fn(x, backend="triton"))
        peer = median_ms(lambda fn=fn: fn(x, backend="torch"))
        yield Row(f"quantise {fmt}", shape, ours, "torch reference", peer, rows * (1024 + out_bytes))
    data, scale = kernels.quantize_kv_fp4(x, backend="triton")
    ours = median_ms(lambda: kernels.dequantize_kv_fp4(data, scale, torch.bfloat16, backend="triton"))
    peer = median_ms(lambda: kernels.dequantize_kv_fp4(data, scale, torch.bfloat16, backend="torch"))
    yield Row("dequantise kv_fp4", shape, ours, "torch reference", peer, rows * (288 + 1024))


def bench_indexer(tiny: bool) -> Iterator[Row]:
    for B, T, S in [(2, 1, 256)] if tiny else [(64, 1, 65_536), (8, 1, 1_048_576), (1, 1024, 65_536)]:
        case = indexer_inputs(B, T, 32, 128, S, ragged=False)
        ours = median_ms(lambda case=case: kernels.indexer_scores(*case, backend="triton"))
        peer = median_ms(lambda case=case: kernels.indexer_scores(*case, backend="torch"))
        yield Row("indexer_scores", f"B={B} T={T} H=32 Di=128 S={S}", ours, "torch reference", peer,
                  B * S * 68, {"B": B, "T": T, "S": S}, {"flops": 2.0 * B * T * 32 * 128 * S})  # fmt: skip


def bench_candidates(tiny: bool) -> Iterator[Row]:
    B, S, top = (2, 4096, 16) if tiny else (64, 1_048_576, 2048)
    scores = randn(B, 1, S)
    n_visible = torch.full((B, 1), S, device=DEVICE)
    ours = median_ms(lambda: kernels.candidate_mask(scores, n_visible, 8, top, backend="triton"))
    peer = median_ms(lambda: candidate_mask_topk(scores, n_visible, 8, top))
    yield Row("candidate_mask", f"B={B} S={S} {top} blocks of 8", ours, "torch.topk form", peer, B * S * 5)


def bench_topk(tiny: bool) -> Iterator[Row]:
    k = 16 if tiny else 512
    for R in [1, 6] if tiny else [1, 6, 256]:
        for L in [512, 2048] if tiny else [4096, 16_384, 65_536, 262_144, 1_048_576]:
            scores = randn(R, L, dtype=torch.bfloat16)
            ours = median_ms(lambda s=scores: kernels.topk_indices(s, k, backend="triton"))
            peer = median_ms(lambda s=scores: torch.topk(s, k, dim=-1))
            yield Row("topk_indices", f"R={R} L={L} k={k} bf16", ours, "torch.topk", peer, R * L * 2 + R * k * 4,
                      {"R": R, "L": L})  # fmt: skip


def step_topk_inputs(model, B: int, context: int, graphs: bool) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """The inputs of every top-k one decode step of `model` runs at batch B and `context` (caches synthesised by
    `filled_decode_batch`): the indexer's and the candidate pool's scores as the model produces them — ties, −inf
    outside the pool, rows masked by their lengths; with `graphs`, the static step a graph captures (rows padded to
    a bucket, views over every reserved entry), run eagerly."""
    batch = filled_decode_batch(model, B, context, 2, graphs=False)
    if graphs:
        batch.graphs = StepGraphs(model, batch.cache, capture=False)
    captured, select = [], kernels.topk_indices

    def keep(scores, k, lengths=None, backend="torch"):
        captured.append((scores.clone(), k, lengths.clone()))
        return select(scores, k, lengths, backend)

    kernels.topk_indices = keep
    try:
        with torch.no_grad():
            batch.decode_step(torch.randint(0, model.args.vocab_size, (B, 1), device=DEVICE))
    finally:
        kernels.topk_indices = select
    return captured


def bench_topk_model(tiny: bool) -> Iterator[Row]:
    """Top-k on the scores a `small` decode step produces (`step_topk_inputs`, the static step's), one row per
    distinct input shape: ours against torch.topk of the same rows."""
    model = build_model(preset("tiny" if tiny else "small"), seed=0, device=DEVICE, dtype=torch.bfloat16)
    for B, context in [(2, 4096)] if tiny else [(1, 1_048_576), (64, 131_072), (64, 1_048_576)]:
        try:
            inputs = step_topk_inputs(model, B, context, graphs=True)
        except torch.OutOfMemoryError as error:
            print(f"  topk-model B={B} ctx={context}: {error}"[:300], flush=True)
            continue
        shapes = {}
        for scores, k, lengths in inputs:
            shapes.setdefault((tuple(scores.shape), k), (scores, lengths))
        for ((R, L), k), (scores, lengths) in shapes.items():
            ours = median_ms(lambda s=scores, n=lengths, k=k: kernels.topk_indices(s, k, n, backend="triton"))
            peer = median_ms(lambda s=scores, k=k: torch.topk(s, min(k, s.shape[-1]), dim=-1))
            yield Row("topk_indices (model scores)", f"B={B} ctx={context} R={R} L={L} k={k}", ours, "torch.topk",
                      peer, scores.numel() * scores.element_size() + R * k * 4, {"R": R, "L": L})  # fmt: skip
        del inputs, shapes
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def bench_attention(B: int, tiny: bool) -> Iterator[Row]:
    """Sparse decode attention at batch B against dense SDPA decode over the same context (64 heads × 128, bf16
    K/V), where the dense K/V fits in memory; ours is timed first, so a fault in a peer leaves its figure."""
    H, D, W, K = (16, 64, 16, 32) if tiny else (64, 512, 128, 512)
    for context in [256, 1024] if tiny else [4096, 16_384, 65_536, 262_144, 1_048_576]:
        case = attention_inputs(B, 1, H, D, W, context, K, ragged=False)
        ours = median_ms(lambda case=case: kernels.sparse_attention(*case, backend="triton"))
        row = Row("sparse_attention", f"B={B} ctx={context} H={H} D={D} W={W} K={K}", ours, "torch reference", None,
                  B * (W * 528 + K * 288 + 2 * H * D * 2), {"B": B, "ctx": context})  # fmt: skip
        print(f"  sparse_attention B={B} ctx={context}: {ours:.4f} ms", flush=True)
        row.peer_ms = median_ms(lambda case=case: kernels.sparse_attention(*case, backend="torch"))
        row.extra |= rope_timings(case, context)
        del case
        # dense K/V under 2^31 elements per tensor: torch's SDPA kernels index with 32-bit offsets
        dense_elements = B * context * 64 * 128
        budget = 1 << 22 if tiny else 40 * GiB
        if dense_elements * 2 <= budget and dense_elements < 2**31:
            q = randn(B, 64, 1, 128, dtype=torch.bfloat16)
            kv = randn(B, 64, context, 128, dtype=torch.bfloat16)
            row.extra["dense_sdpa_ms"] = median_ms(lambda q=q, kv=kv: F.scaled_dot_product_attention(q, kv, kv))
            del q, kv
        else:  # a floor: the dense K and V bytes at the copy bandwidth of this H200 (4.28 TB/s read + write)
            row.extra["dense_floor_ms"] = 2 * dense_elements * 2 / 4.28e12 * 1e3
        yield row
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def rope_timings(case: tuple, position: int) -> dict[str, float]:
    """The decode path's attention — RoPE on q and RoPE⁻¹ on the output inside the kernel — against the same with
    the two RoPE launches around the kernel (the model's 64 rotary dims)."""
    q, *rest = case
    rope = (torch.full(q.shape[:2], position, device=DEVICE), 10000.0 ** -(torch.arange(0, 64, 2.0) / 64).double())

    def apart() -> torch.Tensor:
        rotated = kernels.rope_rotate(q, *rope, inverse=False, backend="triton")
        out = kernels.sparse_attention(rotated, *rest, backend="triton")
        return kernels.rope_rotate(out, *rope, inverse=True, backend="triton")

    fused = median_ms(lambda: kernels.sparse_attention(q, *rest, backend="triton", rope=rope))
    return {"with_rope_ms": fused, "rope_launches_around_ms": median_ms(apart)}


def scaled_mm_peers(x_data: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """torch._scaled_mm at the FP8 GEMM's shapes, with each scaling it takes on this GPU (extra `<scaling> ms`): rows ×
    columns (fp32 per row of x and of W), and DeepSeek-V3's 1 × 128 · 128 × 128 blocks where this torch has them.
    Neither is our format (1 × 32 · 32 × 32 UE8M0 blocks, which _scaled_mm does not take on sm_90): speed peers,
    fed ones as scales. A scaling this torch or GPU refuses is printed and left out."""
    (M, K), N = x_data.shape, w.shape[0]
    a, b = x_data.view(torch.float8_e4m3fn), w.t()  # b: [K, N] column-major, as _scaled_mm wants
    ones = functools.partial(torch.ones, dtype=torch.float32, device=DEVICE)
    scalings = {"rowwise": (ones(M, 1), ones(1, N)),
                "blockwise 1x128/128x128": (ones(K // 128, M).t(), ones(N // 128, K // 128).t())}  # fmt: skip
    peers = {}
    for name, (scale_a, scale_b) in scalings.items():
        try:
            call = functools.partial(torch._scaled_mm, a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
            call()
            peers[f"scaled_mm {name} ms"] = median_ms(call)
        except Exception as error:  # this scaling is not available for these shapes, this torch or this GPU
            print(f"  _scaled_mm {name} M={M} N={N} K={K}: {type(error).__name__}: {error}"[:700], flush=True)
    return peers


def cast_then_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The activation cast's own launch, then the FP8 GEMM: what `fp8_linear_cast` does in one below 32 tokens."""
    return kernels.fp8_linear(*kernels.quantize_swa_fp8(x, "triton"), w, w_scale, x.dtype, "triton")


def bench_fp8_gemm(tiny: bool) -> Iterator[Row]:
    """The FP8 linear (bf16 out) at decode batches against the bf16 F.linear of its dequantised weight (what the model
    ran before) and torch._scaled_mm; bytes = the FP8 weight and its scales, the FP8 activations, the bf16 output."""
    for N, K in [(64, 256), (96, 128)] if tiny else [(1280, 5120), (32768, 1280), (5120, 8192)]:
        _, _, w, w_scale = fp8_linear_inputs(1, N, K)
        w_bf16 = fp8_gemm.dequantize_fp8_weight(w, w_scale, torch.bfloat16)
        for M in [1, 4] if tiny else [1, 64, 256]:
            x_data, x_scale = kernels.quantize_swa_fp8(randn(M, K), backend="triton")
            x_bf16 = kernels.dequantize_swa_fp8(x_data, x_scale, torch.bfloat16, backend="triton")
            ours = median_ms(
                functools.partial(kernels.fp8_linear, x_data, x_scale, w, w_scale, torch.bfloat16, "triton")
            )
            peer = median_ms(functools.partial(F.linear, x_bf16, w_bf16))
            nbytes = N * K + w_scale.numel() + M * K * 33 // 32 + M * N * 2
            yield Row("fp8_linear", f"M={M} N={N} K={K} bf16 out", ours, "bf16 F.linear", peer, nbytes,
                      {"M": M, "N": N, "K": K}, scaled_mm_peers(x_data, w))  # fmt: skip
            if M < fp8_gemm.FOLDED_FROM:  # bf16 activations cast inside the GEMM, against the cast launch + GEMM
                cast = median_ms(functools.partial(kernels.fp8_linear_cast, x_bf16, w, w_scale, "triton"))
                two = median_ms(functools.partial(cast_then_gemm, x_bf16, w, w_scale))
                yield Row("fp8_linear_cast", f"M={M} N={N} K={K} bf16", cast, "cast + fp8_linear", two,
                          nbytes + M * K, {"M": M, "N": N, "K": K})  # fmt: skip


def grouped_bf16(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The bf16 peer of a grouped expert GEMM on dequantised weights w [E, out, in]: torch._grouped_mm where this torch
    and GPU take it (one launch), else a loop over the experts with pairs (their bounds read once, here)."""
    try:
        ends = offsets[1:].clone()  # its own, aligned allocation
        call = functools.partial(torch._grouped_mm, x, w.transpose(1, 2), offs=ends, out_dtype=torch.bfloat16)
        call()
        return call
    except Exception as error:  # no _grouped_mm here: the loop
        print(f"  torch._grouped_mm unavailable ({type(error).__name__}: {error}"[:200] + "): per-expert loop")
    bounds = [(e, lo, hi) for e, (lo, hi) in enumerate(itertools.pairwise(offsets.tolist())) if hi > lo]
    return lambda: torch.cat([F.linear(x[lo:hi], w[e]) for e, lo, hi in bounds])


def dequantised_experts(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Packed experts [E, out, in/2] → bf16 [E, out, in], a few experts at a time (fp32 transients stay small)."""
    block = 2 * w.shape[2] // s.shape[2]
    return torch.cat([quant.fp4_dequant_ue8m0(w[e : e + 8], s[e : e + 8], block, torch.bfloat16)
                      for e in range(0, w.shape[0], 8)])  # fmt: skip


def bench_moe_gemm(tiny: bool) -> Iterator[Row]:
    """The two grouped MXFP4 GEMMs of a routed-expert layer (C = 5120, I = 2304, top-6, bf16 out) at 1 / 64 / 256
    tokens, 48 experts (the expert-parallel rank's share) and 384, against bf16 grouped GEMMs of the dequantised
    weights; bytes = the packed weights and scales of the experts with pairs, the FP8 activations, the bf16 outputs
    (extra `bound_ms`: those bytes at 4.28 TB/s)."""
    C, I = (256, 128) if tiny else (5120, 2304)
    for E, block in [(8, 32), (8, 16)] if tiny else [(48, 32), (48, 16), (384, 32)]:
        weights = expert_weights(E, C, I, block)
        w13_bf16, w2_bf16 = dequantised_experts(*weights[:2]), dequantised_experts(*weights[2:])
        for N in [1, 4] if tiny else [1, 64, 256]:
            m = moe_inputs(weights, N, 6)
            h = kernels.quantize_swa_fp8(m.gate_up("triton"), backend="triton")
            x_bf16 = kernels.dequantize_swa_fp8(m.x_data, m.x_scale, torch.bfloat16, backend="triton")
            x_bf16 = x_bf16[m.order // m.ids.shape[1]]  # each sorted pair's token
            h_bf16 = kernels.dequantize_swa_fp8(*h, torch.bfloat16, backend="triton")
            up_peer, down_peer = grouped_bf16(x_bf16, w13_bf16, m.offsets), grouped_bf16(h_bf16, w2_bf16, m.offsets)
            w13_bytes, w2_bytes = m.weight_bytes()
            P, shape = N * 6, f"E={E} tokens={N} top-6 block {block}"
            params = {"E": E, "N": N, "block": block}
            for name, ours, peer, nbytes in (
                ("moe gate_up", lambda m=m: m.gate_up("triton"), up_peer, w13_bytes + N * C * 33 // 32 + P * I * 2),
                ("moe down", lambda m=m, h=h: m.down(h, "triton"), down_peer, w2_bytes + P * I * 33 // 32 + P * C * 2),
            ):
                yield Row(name, shape, median_ms(ours), "bf16 grouped GEMM", median_ms(peer), nbytes, params,
                          {"bound_ms": nbytes / 4.28e12 * 1e3})  # fmt: skip
        del w13_bf16, w2_bf16, weights
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def tuning_row(kernel: str, shape: str, fn: Callable[[], torch.Tensor], want: torch.Tensor, nbytes: int) -> Row:
    """One launch shape (the defaults come from these rows): its median time, and whether it computes what the
    default launch shape does."""
    got = fn()
    same = torch.equal(got, want) if got.dtype in (torch.int32, torch.bool) else torch.allclose(got, want, 1e-2, 1e-2)
    return Row(kernel, shape, median_ms(fn), "", None, nbytes, extra={"same_as_default": float(same)})


def tune(kernel: str, shape: str, fn: Callable[[], torch.Tensor], want, nbytes: int) -> Iterator[Row]:
    try:
        yield tuning_row(kernel, shape, fn, want, nbytes)
    except Exception as error:  # a launch shape that does not compile or fit: noted, not fatal
        print(f"  {kernel} {shape}: {type(error).__name__}: {error}"[:500], flush=True)


def tune_topk(tiny: bool) -> Iterator[Row]:
    """Launch shapes of top-k at batch 256 and 1, on Gaussian rows and, at 256 × 64 K, heavy-tailed ones: the
    defaults of `topk.TopKTuning` against 4 K / 16 K groups, 8 K scores per group-max program, 512 / 2048
    per gathering program, a select tile of 2048, its 4 warps, the threshold's 8."""
    variants = [{}, {"max_groups": 4096}, {"max_groups": 16384}, {"group_tile": 8192}, {"gather": 512},
                {"gather": 2048}, {"tile": 2048}, {"num_warps": 4}, {"threshold_warps": 8}]  # fmt: skip
    k = 16 if tiny else 512
    shapes = [(2, 8192)] if tiny else [(256, 65_536), (256, 262_144), (256, 1_048_576), (1, 1_048_576)]
    rows = [(R, L, "gaussian", randn(R, L, dtype=torch.bfloat16)) for R, L in shapes]
    R, L = shapes[0]
    rows.append((R, L, "heavy-tailed", randn(R, L).mul(3).exp().to(torch.bfloat16)))
    for R, L, kind, scores in rows:
        want = topk.topk_indices_triton(scores, k, None)
        for variant in variants:
            fn = functools.partial(topk.topk_indices_triton, scores, k, None, topk.TopKTuning(**variant))
            yield from tune("tune topk", f"R={R} L={L} {kind} {variant or 'default'}", fn, want, R * L * 2)


def kernel_device_us(fn: Callable[[], object], calls: int = 20) -> dict[str, float]:
    """Device microseconds per call of fn in each CUDA kernel it launches, by kernel name (torch.profiler over
    `calls` calls after one warm-up); nothing on the CPU."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def topk_phases(tiny: bool) -> Iterator[Row]:
    """Where a top-k call's time goes: each of its kernels' device time per call (extra `µs <kernel>`; none on the
    CPU) beside the whole call's median, at the issue's batch-256 shapes and one row of 1 M."""
    k = 16 if tiny else 512
    shapes = [(2, 8192)] if tiny else [(256, 65_536), (256, 262_144), (256, 1_048_576), (1, 1_048_576)]
    for R, L in shapes:
        call = functools.partial(topk.topk_indices_triton, randn(R, L, dtype=torch.bfloat16), k, None)
        phases = {f"µs {name.strip('_').removesuffix('_kernel')}": us for name, us in kernel_device_us(call).items()}
        yield Row("topk phases", f"R={R} L={L} k={k} bf16", median_ms(call), "", None, R * L * 2, {"R": R, "L": L},
                  phases)  # fmt: skip


def tune_attention(tiny: bool) -> Iterator[Row]:
    """Launch shapes of sparse attention at batch 1, 8 and 64: heads per program, keys per tile, warps, and (the
    default shape) fewer key-range splits than `sparse_attn._splits` picks."""
    shapes = [(16, 64, 8), (32, 64, 8), (64, 32, 8), (64, 64, 16)]
    variants = [dict(zip(("block_h", "block_n", "num_warps"), shape, strict=True)) for shape in shapes]
    variants += [{"splits": n} for n in (1, 2, 4, 10)]
    for B in [1] if tiny else [1, 8, 64]:
        if tiny:
            case = attention_inputs(B, 1, 64, 64, 16, 256, 32, False)
        else:
            case = attention_inputs(B, 1, 64, 512, 128, 65_536, 512, ragged=False)
        want = sparse_attn.sparse_attention_triton(*case)
        for variant in variants[:2] if tiny else variants:
            fn = functools.partial(sparse_attn.sparse_attention_triton, *case, **variant)
            shape = f"B={B} " + " ".join(f"{k}={v}" for k, v in variant.items())
            yield from tune("tune attention", shape, fn, want, B * (128 * 528 + 512 * 288))


def tune_quantisers(tiny: bool) -> Iterator[Row]:
    """Launch shapes of the quantisers (elements, or bf16 pairs, per program; warps) on 1 GiB of bf16."""
    rows = 64 if tiny else 1 << 20
    x = randn(rows, 512, dtype=torch.bfloat16)
    for name, fmt, out_bytes in (("kv_fp4", kv_quant.FP4_E4M3, 288), ("swa_fp8", kv_quant.FP8_UE8M0, 528)):
        want = kv_quant.quantize_triton(x, fmt.value)[0]
        for tile, warps in [(4096, 4)] if tiny else [(1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (2048, 2)]:
            fn = functools.partial(kv_quant.quantize_triton, x, fmt.value, tile, warps)
            shape = f"{name} {rows}×512 bf16 tile={tile} warps={warps}"
            yield from tune("tune quantise", shape, lambda fn=fn: fn()[0], want, rows * (1024 + out_bytes))


def tune_indexer(tiny: bool) -> Iterator[Row]:
    """Launch shapes around the indexer's defaults (`indexer.IndexerTuning`), each checked against the default
    launch: decode at B=64 × 64 K, B=8 × 1 M and the small B=1 × 64 K, B=4 × 128 K — 128 × 8 / 16 / 32 / 64 positions
    per program, 256 × 32 uncapped (two programs per SM), no register cap, 4 pipeline stages, per-thread loads
    instead of TMA and the FP16 operand (GPUs before sm_89); the prefill tile at B=1, T=1024, S=64 K — 64 positions,
    8 warps, one tile per program, per-thread loads."""
    decode = [{"block_s": 128, "tiles_per_program": t} for t in (8, 16, 32, 64)]
    decode += [{"block_s": 256, "tiles_per_program": 32}, {"max_registers": 255}, {"num_stages": 4}, {"tma": False},
               {"operand": indexer.FP16.value}]  # fmt: skip
    prefill = [{"block_s": 64}, {"num_warps": 8}, {"tiles_per_program": 1}, {"tma": False}]
    if tiny:  # the interpreter: fp32 (or exact fp16) dots
        shapes = [(2, 1, 256, [{"block_s": 16, "tiles_per_program": 4}, {"operand": indexer.FP16.value}])]
    else:
        shapes = [(64, 1, 65_536, decode), (8, 1, 1_048_576, decode), (1, 1, 65_536, decode), (4, 1, 131_072, decode),
                  (1, 1024, 65_536, prefill)]  # fmt: skip
    for B, T, S, variants in shapes:
        case = indexer_inputs(B, T, 32, 128, S, ragged=False)
        want = indexer.indexer_scores_triton(*case)
        t = indexer.IndexerTuning().resolved(B, T, S)
        default = {"block_s": t.block_s, "tiles_per_program": t.tiles_per_program}
        for variant in [{}, *(v for v in variants if v != default)]:
            fn = functools.partial(indexer.indexer_scores_triton, *case, indexer.IndexerTuning(**variant))
            yield from tune("tune indexer", f"B={B} T={T} S={S} {variant or default}", fn, want, B * S * 68)


def tune_mhc(tiny: bool) -> Iterator[Row]:
    """Launch shapes of an mHC site's coefficients (`hc_mixes.MixTuning`), n = 4 streams of C = 512 (`small`) and
    5120 (V4.1-Flash) channels at 1, 64 and 256 rows, with the residual update made in the projection's pass
    (`update`) and without (`plain`): the served shape (`hc_mixes.MIXES`, `default`, its kernels' device time each)
    beside the class's base shape (`{}`) and others — channels an iteration takes, the split count, the
    projection's warps and stages, the Sinkhorn kernel's warps."""
    n, M = 4, 24
    variants = [None, {}, {"max_splits": 32}, {"max_splits": 64}, {"max_splits": 128, "block_k": 32},
                {"num_warps": 2}, {"num_stages": 1}, {"sinkhorn_warps": 1},
                {"max_splits": 64, "block_k": 32, "num_warps": 1},
                {"max_splits": 64, "num_warps": 2, "num_stages": 1, "sinkhorn_warps": 1}]  # fmt: skip
    shapes = [(64, 2)] if tiny else [(512, 1), (512, 64), (512, 256), (5120, 1), (5120, 64)]
    for (C, R), kind in itertools.product(shapes, ("update", "plain")):
        X, out = randn(R, n, C, dtype=torch.bfloat16), randn(R, C, dtype=torch.bfloat16)
        post, comb = torch.rand(R, n, device=DEVICE) * 2, torch.rand(R, n, n, device=DEVICE)
        fn, scale, base = randn(M, n * C) * 0.02, torch.rand(3, device=DEVICE), randn(M)
        if kind == "update":
            op, args = hc_mixes.hc_expand_coefficients_triton, (out, X, post, comb, fn, scale, base, n, 20, 1e-6, 1e-6)
        else:
            op, args = hc_mixes.hc_coefficients_triton, (X, fn, scale, base, n, 20, 1e-6, 1e-6)
        want = op(*args)[-1]
        for variant in variants[:2] if tiny else variants:
            call = functools.partial(op, *args, *([] if variant is None else [hc_mixes.MixTuning(**variant)]))
            shape = f"{kind} R={R} C={C} {'default' if variant is None else variant}"
            for row in tune("tune mhc", shape, lambda call=call: call()[-1], want, M * n * C * 4 + R * n * C * 4):
                if variant is None:
                    row.extra |= {f"µs {k.strip('_').removesuffix('_kernel')}": us
                                  for k, us in kernel_device_us(call).items()}  # fmt: skip
                yield row


def tune_fp8_gemm(tiny: bool) -> Iterator[Row]:
    """Launch shapes of the FP8 linear around `FP8GemmTuning()`'s defaults at decode batches, each checked against the
    default launch: weight rows per tile, K per stage, stages, warps, K splits, token tiles, the other dots."""
    variants = [{"block_n": 64}, {"block_k": 256}, {"num_stages": 3}, {"num_stages": 6}, {"num_warps": 8},
                {"split_k": 1}, {"block_m": 32}, {"block_n": 64, "split_k": 1}, {"dot": "fp8"}, {"dot": "bf16"},
                {"block_m": 64, "num_stages": 4}, {"num_warps": 4}]  # fmt: skip
    for M, N, K in [(1, 64, 256)] if tiny else [(1, 1280, 5120), (64, 5120, 8192), (256, 5120, 8192)]:
        case = fp8_linear_inputs(M, N, K)
        want = fp8_gemm.fp8_linear_triton(*case, torch.bfloat16)
        for variant in [{}, *(variants[:2] if tiny else variants)]:
            fn = functools.partial(fp8_gemm.fp8_linear_triton, *case, torch.bfloat16, kernels.FP8GemmTuning(**variant))
            yield from tune("tune fp8_linear", f"M={M} N={N} K={K} {variant or 'default'}", fn, want, N * K)


def tune_moe_gemm(tiny: bool) -> Iterator[Row]:
    """Launch shapes of the grouped expert GEMMs around `MoEGemmTuning()`'s defaults (C = 5120, I = 2304, top-6,
    block 32), each checked against the default launch: columns per program, K per stage, stages, pairs per tile,
    warps, the arithmetic nibble decode instead of the PTX table lookups, and FP8 code dots per 32-input chunk."""
    variants = [{"block_n": 256}, {"block_n": 64}, {"block_k": 256, "num_warps": 8, "num_stages": 3},
                {"num_stages": 4}, {"num_stages": 6}, {"block_m": 64}, {"num_warps": 8}, {"ptx": False},
                {"dot": "fp8"}, {"dot": "fp8", "num_warps": 8}, {"dot": "fp8", "block_k": 256},
                {"dot": "fp8", "block_m": 16}]  # fmt: skip
    C, I = (256, 128) if tiny else (5120, 2304)
    for E, N in [(8, 4)] if tiny else [(48, 64), (48, 256), (384, 256)]:
        m = moe_inputs(expert_weights(E, C, I, 32), N, 6)
        h = kernels.quantize_swa_fp8(m.gate_up("triton"), backend="triton")
        w13_bytes, w2_bytes = m.weight_bytes()
        up, down = m.gate_up("triton"), m.down(h, "triton")
        for variant in [{}, *(variants[:1] if tiny else variants)]:
            shape = f"E={E} tokens={N} {variant or 'default'}"
            fn = functools.partial(m.gate_up, "triton", **variant)
            yield from tune("tune moe gate_up", shape, fn, up, w13_bytes)
            yield from tune("tune moe down", shape, functools.partial(m.down, h, "triton", **variant), down, w2_bytes)


# ----------------------------------------------------------------------------------------------- decode step


def decode_model(tiny: bool, context: int):
    """The `small` preset (`tiny` on CPU) in bf16 (fp32 on CPU), random weights, its context limit raised."""
    args = preset("tiny" if tiny else "small")
    args = dataclasses.replace(args, max_position_embeddings=max(args.max_position_embeddings, 2 * context))
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return build_model(args, device=DEVICE, dtype=dtype)


def filled_decode_batch(model, B: int, context: int, steps: int, graphs: bool | None = None):
    """A decode batch of B sequences at `context` tokens, its packed state synthesised instead of prefilled: random
    FP8 ring entries holding the last W positions, random packed FP4 main-KV / indexer-K entries, random Engram
    look-back ids. Decode reads exactly these tensors; their values only shape the scores. The entries are as many as
    the graphs reserve for `steps` more steps (each may verify the widest draft): no growth — which would drop the
    graphs and time their capture — within them. `graphs`: as `DecodeBatch`'s (None: CUDA graphs on a GPU)."""
    a = model.args
    batch = DecodeBatch(model, B, graphs=graphs)
    cache = batch.cache
    for _ in range(B):
        cache.add_row()
    W, D, Di = a.sliding_window, a.head_dim, a.index_head_dim
    positions = torch.arange(context - W, context, device=DEVICE)
    for ring in cache.rings.values():
        ring.data.copy_(valid_e4m3(*ring.data.shape))
        ring.scale.copy_(valid_ue8m0_scales(*ring.scale.shape))
        ring.pos[:, positions % W] = positions
    reach = max(context + steps, MIN_CONTEXT) + 1 + a.dspark_block_size  # the positions StepGraphs.prepare reserves
    for layer, entries in cache.entries.items():
        n = Entries.room(reach // a.compress_ratios[layer] + 1)
        entries.kv_data, entries.kv_scale = random_bytes(B, n, D // 2), valid_e4m3_scales(B, n, D // 16)
        entries.k_data, entries.k_scale = random_bytes(B, n, Di // 2), valid_ue8m0_scales(B, n, Di // 32)
    cache.history.copy_(torch.randint(0, a.vocab_size, cache.history.shape, device=DEVICE))
    if cache.host_history is not None:
        cache.host_history.copy_(cache.history.cpu())
    cache.pos[:] = [context] * B
    batch.seq_ids = list(range(B))
    return batch


def dense_decode_step(model, tokens: torch.Tensor, position: int, history: torch.Tensor, kv: torch.Tensor):
    """The dense-attention baseline of the same size: the same embedding, layers, Engram, MoE and head, but every
    attention layer's 8 heads attend to all `position` past tokens' 512-dim K = V latents in bf16 (one KV head, as
    the model's shared latent) instead of window + selected FP4 entries: softmax(q·Kᵀ)·V as two batched matmuls
    (torch's SDPA kernel for 512-dim heads does not split a long context over the GPU at batch 1). `kv` [B, ctx, D]
    is one buffer that every layer reads (each read is far beyond the L2, so it costs what 12 buffers would)."""
    positions = torch.full(tokens.shape, position, device=DEVICE)

    def attend(block, x: torch.Tensor, xq) -> torch.Tensor:
        attn = block.attn
        _qr, q = attn.query(xq, positions)  # [B, 1, H, D]
        logits = torch.bmm(q[:, 0], kv.transpose(1, 2)).float() * attn.softmax_scale  # [B, H, ctx]
        o = torch.bmm(logits.softmax(-1).to(kv.dtype), kv)  # [B, H, D]
        return attn.project_out(o[:, None], positions)

    X, pre = model.embed_stream(tokens)
    memory = DeviceMemory(model, tokens, history)
    X, pre = model.run_layers(range(model.args.num_hidden_layers), X, pre, attend, memory)
    return model.logits(X[:, -1:], pre[:, -1:])


def ours_step(model, B: int, context: int, steps: int) -> Callable[[], object]:
    """The eager `DecodeBatch.decode_step` over a synthesised decode batch at `context` tokens (like the dense side;
    bench/step_bench.py compares the served graph with a graph of the dense model)."""

    batch = filled_decode_batch(model, B, context, steps, graphs=False)
    tokens = torch.randint(0, model.args.vocab_size, (B, 1), device=DEVICE)
    return lambda: batch.decode_step(tokens)


def dense_step(model, B: int, context: int, steps: int) -> Callable[[], object]:
    """The dense baseline's decode step at `context` tokens (random bf16 K = V latents)."""
    tokens = torch.randint(0, model.args.vocab_size, (B, 1), device=DEVICE)
    history = torch.randint(0, model.args.vocab_size, (B, model.ngram.history_len), device=DEVICE)
    kv = randn(B, context, model.args.head_dim, dtype=model.dtype)
    return lambda: dense_decode_step(model, tokens, context, history, kv)


def decode_step_bench(name: str, make_step: Callable[..., Callable[[], object]], tiny: bool) -> Iterator[Row]:
    """Median wall time of one whole eager decode step (one token per sequence, synchronised) at batch 1 and 64 and
    each context; a configuration that fails is reported and skipped."""
    contexts = [64, 256] if tiny else [4096, 131_072, 1_048_576]
    repeat = 2 if tiny else 5
    model = decode_model(tiny, contexts[-1])
    for B in [1, 4] if tiny else [1, 64]:
        for context in contexts:
            try:
                with torch.no_grad():
                    ms = wall_ms(make_step(model, B, context, repeat + 2), repeat)
            except Exception as error:  # e.g. out of memory: the other configurations still run
                print(f"  {name} B={B} ctx={context} raised {type(error).__name__}: {error}"[:2000], flush=True)
                continue
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            yield Row(name, f"{'tiny' if tiny else 'small'} B={B} ctx={context}", ms, "", None, 0,
                      {"B": B, "ctx": context})  # fmt: skip
            print(f"  {name} B={B} ctx={context}: {ms:.2f} ms", flush=True)


SECTIONS: dict[str, Callable[[bool], Iterator[Row]]] = {
    "copy": bench_copy,
    "quant": bench_quantisers,
    "indexer": bench_indexer,
    "candidates": bench_candidates,
    "topk": bench_topk,
    "topk-model": bench_topk_model,
    "attention-1": lambda tiny: bench_attention(1, tiny),
    "attention-64": lambda tiny: bench_attention(64 if not tiny else 2, tiny),
    "attention-256": lambda tiny: bench_attention(256 if not tiny else 3, tiny),
    "tune-topk": tune_topk,
    "topk-phases": topk_phases,
    "tune-attention": tune_attention,
    "tune-indexer": tune_indexer,
    "tune-quant": tune_quantisers,
    "tune-mhc": tune_mhc,
    "fp8-gemm": bench_fp8_gemm,
    "moe-gemm": bench_moe_gemm,
    "tune-fp8-gemm": tune_fp8_gemm,
    "tune-moe-gemm": tune_moe_gemm,
    "step-ours": lambda tiny: decode_step_bench("decode step", ours_step, tiny),
    "step-dense": lambda tiny: decode_step_bench("decode step, dense", dense_step, tiny),
}


def run_section(name: str, tiny: bool, parts: Path) -> None:
    """One section → parts/<name>.json (rows, environment), rewritten after every row, so that a section stopped
    by a time limit keeps what it measured; an exception is reported in the file, not raised."""
    print(f"section {name}", flush=True)
    torch.manual_seed(0)
    parts.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result: dict[str, object] = {"section": name, "environment": environment(), "rows": [], "seconds": 0.0}

    def save() -> None:
        result["seconds"] = time.perf_counter() - started
        (parts / f"{name}.json").write_text(json.dumps(result, indent=1))

    try:
        for row in SECTIONS[name](tiny):
            result["rows"].append(asdict(row))
            save()
    except Exception as error:  # keep going: report what ran
        result["error"] = f"{type(error).__name__}: {error}"[-3000:]
        print(f"  section {name} raised {result['error']}", flush=True)
    save()


# ----------------------------------------------------------------------------------------------- report


def report(parts: Path, out_dir: Path) -> dict:
    order = list(SECTIONS)
    sections = [json.loads(p.read_text()) for p in parts.glob("*.json") if p.stem in order]
    sections.sort(key=lambda s: order.index(s["section"]))
    rows = [Row(**r) for s in sections for r in s["rows"]]
    copy = next((r.bandwidth() for r in rows if r.kernel == "copy"), None) or 4.28e12
    pair_dense_baseline(rows)
    print_table(rows, copy)
    errors = {s["section"]: s["error"] for s in sections if "error" in s}
    for name, error in errors.items():
        print(f"section {name} failed: {error}")
    env = next((s["environment"] for s in sections), environment())
    result = {"environment": env, "copy_bandwidth_Bps": copy, "section_errors": errors,
              "section_seconds": {s["section"]: s["seconds"] for s in sections},
              "rows": [asdict(r) | {"bandwidth_Bps": r.bandwidth()} for r in rows]}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(result, indent=1))
    plot(rows, out_dir)
    return result


def pair_dense_baseline(rows: list[Row]) -> None:
    """The dense decode steps (their own process) become the peer of ours at the same batch and context."""
    ours = {(r.params["B"], r.params["ctx"]): r for r in rows if r.kernel == "decode step"}
    paired = []
    for r in rows:
        key = (r.params.get("B"), r.params.get("ctx"))
        if r.kernel == "decode step, dense" and key in ours:
            ours[key].peer, ours[key].peer_ms = "dense model", r.ours_ms
            paired.append(r)
    rows[:] = [r for r in rows if all(r is not p for p in paired)]


def print_table(rows: list[Row], copy: float) -> None:
    head = f"{'kernel':<20} {'shape':<44} {'ours ms':>9} {'GB/s':>8} {'% copy':>7} {'peer':<16} {'peer ms':>9} {'×':>6}"
    print(f"\ndevice-to-device copy: {copy / 1e12:.2f} TB/s (read + write)\n" + head + "\n" + "-" * len(head))
    for r in rows:
        bandwidth = r.bandwidth()
        speedup = f"{r.peer_ms / r.ours_ms:6.2f}" if r.peer_ms and r.ours_ms else "     –"
        peer_ms = f"{r.peer_ms:9.4f}" if r.peer_ms else "        –"
        gbs = f"{bandwidth / 1e9:8.0f} {100 * bandwidth / copy:6.1f}%" if bandwidth else f"{'–':>8} {'–':>7}"
        print(f"{r.kernel:<20} {r.shape:<44} {r.ours_ms or 0:9.4f} {gbs} {r.peer:<16} {peer_ms} {speedup}")
        phases = {key.removeprefix("µs "): us for key, us in r.extra.items() if key.startswith("µs ")}
        if phases:
            print(f"{'':<20}   µs per call: " + ", ".join(f"{name} {us:.1f}" for name, us in phases.items()))
        if r.extra.get("same_as_default") == 0.0:
            print(f"{'':<20}   ^ its output DIFFERS from the default launch shape's", flush=True)
        for key, label in (("dense_sdpa_ms", "dense SDPA"), ("dense_floor_ms", "dense floor")):
            if key in r.extra:
                dense = r.extra[key]
                print(f"{'':<20} {'  vs dense decode (64×128, bf16)':<44} {'':>9} {'':>8} {'':>7} "
                      f"{label:<16} {dense:9.4f} {dense / r.ours_ms:6.2f}")  # fmt: skip
        for key, ms in r.extra.items():  # more peers (`<peer> ms`) and the bandwidth bound (`bound_ms`)
            if key.endswith(" ms") or key == "bound_ms":
                label = "  vs " + ("the bytes at 4.28 TB/s" if key == "bound_ms" else key.removesuffix(" ms"))
                print(f"{'':<20} {label:<44} {'':>9} {'':>8} {'':>7} {'':<16} {ms:9.4f} {ms / r.ours_ms:6.2f}")
    print(flush=True)


def plot(rows: list[Row], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(kernel: str, group: str, x: str) -> dict[int, list[tuple[int, Row]]]:
        groups: dict[int, list[tuple[int, Row]]] = {}
        for r in rows:
            if r.kernel == kernel and r.ours_ms:
                groups.setdefault(r.params[group], []).append((r.params[x], r))
        return groups

    def save(fig, ax, name: str, **labels: str) -> None:
        ax.set(xscale="log", yscale="log", **labels)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for R, points in series("topk_indices", "R", "L").items():
        xs = [x for x, _ in points]
        line = ax.plot(xs, [r.ours_ms for _, r in points], "o-", label=f"ours, batch {R}")[0]
        ax.plot(xs, [r.peer_ms for _, r in points], "x--", color=line.get_color(), label=f"torch.topk, batch {R}")
    save(fig, ax, "kernels_topk.png", xlabel="row length", ylabel="ms (median)", title="top-512 of bf16 rows")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for B, points in series("sparse_attention", "B", "ctx").items():
        xs = [x for x, _ in points]
        line = ax.plot(xs, [r.ours_ms for _, r in points], "o-", label=f"sparse FP4/FP8 (ours), batch {B}")[0]
        dense = [(x, r.extra["dense_sdpa_ms"]) for x, r in points if "dense_sdpa_ms" in r.extra]
        if dense:
            ax.plot(*zip(*dense, strict=True), "x--", color=line.get_color(), label=f"dense SDPA decode, batch {B}")
        floor = [(x, r.extra["dense_floor_ms"]) for x, r in points if "dense_floor_ms" in r.extra]
        if floor:
            ax.plot(*zip(*floor, strict=True), ":", color=line.get_color(), label=f"dense K/V read floor, batch {B}")
    save(fig, ax, "kernels_attention.png", xlabel="context (tokens)", ylabel="ms (median)",
         title="decode attention, 64 heads: sparse 128 + 512 keys vs dense")  # fmt: skip

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for B, points in series("decode step", "B", "ctx").items():
        xs = [x for x, _ in points]
        line = ax.plot(xs, [r.ours_ms for _, r in points], "o-", label=f"V4.1 sparse (ours), batch {B}")[0]
        dense = [(x, r.peer_ms) for x, r in points if r.peer_ms]
        if dense:
            ax.plot(*zip(*dense, strict=True), "x--", color=line.get_color(), label=f"dense attention, batch {B}")
    save(fig, ax, "kernels_decode_step.png", xlabel="context (tokens)", ylabel="ms per step (median)",
         title="whole decode step, `small` preset")  # fmt: skip


def environment() -> dict[str, str]:
    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "multiprocessors": str(props.multi_processor_count), "cuda": str(torch.version.cuda)}
    else:
        env["gpu"] = "none (Triton interpreter on CPU)"
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        nargs="?",
        const="all",
        default="",
        help="run the correctness checks at real "
        "sizes: all, or some of quant, activations, indexer, candidates, topk, attention, fp8-gemm, moe-gemm, "
        "row-gather (comma-separated)",
    )
    parser.add_argument("--bench", default="", help=f"sections, comma-separated, or 'all': {', '.join(SECTIONS)}")
    parser.add_argument("--report", action="store_true", help="merge the sections' JSON in --parts (after --bench)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a CPU smoke run of this script")
    out = Path(os.environ.get("OUT", "bench/out"))
    parser.add_argument("--out", type=Path, default=out, help="kernels.json and the PNG plots")
    parser.add_argument("--parts", type=Path, default=out / "kernels_parts", help="one JSON per section")
    parser.add_argument("--isolated", action="store_true", help="one process per check run and section")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="--isolated: start nothing after (s)")
    parser.add_argument("--item-limit", type=float, default=150, help="--isolated: seconds per process")
    args = parser.parse_args()
    names = list(SECTIONS) if args.bench == "all" else [n for n in args.bench.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)} or 'all'")
    print(json.dumps(environment()), flush=True)
    if args.isolated:
        return run_isolated(args, names)
    torch.manual_seed(0)
    failures = run_checks(args.check.split(","), args.tiny) if args.check else []
    for name in names:
        run_section(name, args.tiny, args.parts)
    if args.report or args.bench == "all":
        report(args.parts, args.out)
    if failures:
        print(f"{len(failures)} check(s) FAILED: {', '.join(failures)}")
        return 1
    return 0


def run_isolated(args: argparse.Namespace, names: list[str]) -> int:
    """The checks, then each section, in a process of its own under `--item-limit` seconds; nothing starts after
    `--deadline` seconds; then the report. Exit status: the checks'."""
    started = time.perf_counter()
    common = [sys.executable, __file__, "--parts", str(args.parts)] + (["--tiny"] if args.tiny else [])
    items = ([["--check", args.check]] if args.check else []) + [["--bench", name] for name in names]
    status = 0
    for item in items:
        if time.perf_counter() - started > args.deadline:
            print(f"skipped {' '.join(item)}: past the {args.deadline:.0f} s deadline", flush=True)
            continue
        try:
            rc = subprocess.run(common + item, timeout=args.item_limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"{' '.join(item)}: exit {rc} at {time.perf_counter() - started:.0f} s", flush=True)
        if item[0] == "--check" and rc != 0:
            status = 1
    report(args.parts, args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
