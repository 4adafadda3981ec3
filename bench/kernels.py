"""Kernel benchmarks and checks at real sizes (issue 4): ours (Triton) beside the torch peers, in one run.

    python bench/kernels.py --check            # the CPU tests' checks at real sizes on the GPU; exit 1 on a failure
    python bench/kernels.py                    # the performance table (stdout), JSON and PNG plots
    python bench/kernels.py --check --bench    # both, in one process (one GPU lease)
    python bench/kernels.py --tiny --check --bench   # smoke run of this script on CPU (Triton interpreter)

For each kernel: median time (CUDA-graph replay), effective bandwidth = bytes it must move / time, that as a % of
the device-to-device copy bandwidth measured in the same run, and the speed-up over the torch peer. Imports only
torch, triton, numpy, matplotlib and the standard library besides model.kernels (the GPU image has nothing else).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton

from model import kernels, quant
from model.kernels import indexer, sparse_attn, topk

GiB = 1 << 30


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


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy of fp32 (16-byte vector accesses), bytes read + written per second."""
    src = torch.randn(nbytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


@dataclass
class Row:
    kernel: str
    shape: str
    ours_ms: float
    peer: str
    peer_ms: float | None
    bytes_moved: int
    extra: dict[str, float] = field(default_factory=dict)

    def bandwidth(self) -> float:
        return self.bytes_moved / (self.ours_ms * 1e-3)


# ----------------------------------------------------------------------------------------------- inputs


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def random_bytes(*shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=DEVICE)


def valid_fp4_bytes(*shape: int) -> torch.Tensor:
    return random_bytes(*shape)  # every byte is two valid E2M1 codes


def valid_e4m3_scales(*shape: int) -> torch.Tensor:
    return torch.randint(0x20, 0x48, shape, dtype=torch.uint8, device=DEVICE)  # 2^-3 … 2^2: no NaN


def valid_ue8m0_scales(*shape: int) -> torch.Tensor:
    return torch.randint(122, 131, shape, dtype=torch.uint8, device=DEVICE)


def indexer_inputs(B: int, T: int, H: int, Di: int, S: int, ragged: bool) -> tuple[torch.Tensor, ...]:
    q_data, q_scale = kernels.quantize_index_fp4(randn(B, T, H, Di), backend="triton")
    k_data, k_scale = kernels.quantize_index_fp4(randn(B, S, Di) * 0.3, backend="triton")
    weights = randn(B, T, H)
    n_visible = torch.randint(0, S + 1, (B, T), device=DEVICE) if ragged else torch.full((B, T), S, device=DEVICE)
    return q_data, q_scale, weights, k_data, k_scale, n_visible


def attention_inputs(B: int, T: int, H: int, D: int, W: int, N: int, K: int, ragged: bool) -> tuple:
    q = randn(B, T, H, D, dtype=torch.bfloat16)
    swa_data, swa_scale = kernels.quantize_swa_fp8(randn(B, W, D), backend="triton")
    swa_mask = torch.rand(B, T, W, device=DEVICE) < (0.8 if ragged else 2.0)
    kv_data, kv_scale = valid_fp4_bytes(B, N, D // 2), valid_e4m3_scales(B, N, D // 16)
    idx = torch.randint(0, N, (B, T, K), device=DEVICE, dtype=torch.int32)  # repeats allowed: the kernel may see any
    if ragged:
        idx = torch.where(torch.rand(B, T, K, device=DEVICE) < 0.1, -1, idx)
    sink = randn(H)
    return q, swa_data, swa_scale, swa_mask, kv_data, kv_scale, idx, sink, D**-0.5


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


def check_quantisers(c: Checks, rows: int) -> None:
    magnitudes = 2.0 ** torch.randint(-30, 30, (rows, 1), device=DEVICE).float()
    for dtype in (torch.bfloat16, torch.float32):
        x = (randn(rows, 512) * magnitudes).to(dtype)
        x[: rows // 8] = quant.E2M1_VALUES.to(DEVICE)[torch.randint(0, 16, (rows // 8, 512), device=DEVICE)] * 0.5
        for fmt in ("kv_fp4", "index_fp4", "swa_fp8"):
            want = getattr(kernels, f"quantize_{fmt}")(x, backend="torch")
            got = getattr(kernels, f"quantize_{fmt}")(x, backend="triton")
            bad = sum(int((g != w).sum()) for g, w in zip(got, want, strict=True))
            back_t = getattr(kernels, f"dequantize_{fmt}")(*want, torch.bfloat16, backend="torch")
            back = getattr(kernels, f"dequantize_{fmt}")(*want, torch.bfloat16, backend="triton")
            bad_back = int((back.view(torch.int16) != back_t.view(torch.int16)).sum())
            c.report(f"quantise {fmt} {dtype}", bad == 0 and bad_back == 0, f"{rows}×512, {bad} bytes differ, "
                     f"{bad_back} dequantised values differ")  # fmt: skip


def check_indexer(c: Checks, B: int, T: int, S: int) -> None:
    case = indexer_inputs(B, T, 32, 128, S, ragged=True)
    want = kernels.indexer_scores(*case, backend="torch")
    got = kernels.indexer_scores(*case, backend="triton")
    q = quant.fp4_dequant_ue8m0(*case[:2])
    k = quant.fp4_dequant_ue8m0(*case[3:5])
    bound = torch.einsum("bth,bths->bts", case[2].abs(), torch.einsum("bthd,bsd->bths", q, k).abs()) * 2.0**-20
    finite = torch.isfinite(want)
    same_mask = bool(torch.equal(torch.isinf(got), torch.isinf(want)))
    excess = float(((got - want).abs() - bound)[finite].max()) if finite.any() else 0.0
    c.report(
        f"indexer B={B} T={T} S={S}", same_mask and excess <= 0, f"mask equal {same_mask}, worst excess {excess:.2e}"
    )


def check_candidates(c: Checks, B: int, T: int, S: int, topk_blocks: int) -> None:
    scores = randn(B, T, S)
    n_visible = torch.randint(1, S + 1, (B, T), device=DEVICE)
    n_visible[0, 0] = S
    want = kernels.candidate_mask(scores, n_visible, 8, topk_blocks, backend="torch")
    got = kernels.candidate_mask(scores, n_visible, 8, topk_blocks, backend="triton")
    c.report(f"candidate_mask B={B} T={T} S={S}", bool(torch.equal(got, want)), f"{int((got != want).sum())} differ")


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
    ties = torch.randint(0, 3, (R, L), device=DEVICE).to(torch.bfloat16)  # a third of each row ties at the top
    got = kernels.topk_indices(ties, k, None, backend="triton")
    ok, detail = topk_is_valid(ties, torch.full((R,), L, device=DEVICE), k, got)
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


def run_checks(tiny: bool) -> list[str]:
    print("checks (Triton against the torch references)", flush=True)
    c = Checks()
    if tiny:
        plan = [(check_quantisers, 16), (check_indexer, 2, 3, 100), (check_candidates, 1, 2, 200, 4),
                (check_topk, [(3, 300, 8)]), (check_attention, 1, 2, 100)]  # fmt: skip
    else:
        plan = [(check_quantisers, 1 << 16), (check_indexer, 8, 1, 70_001), (check_indexer, 1, 300, 20_000),
                (check_candidates, 4, 2, 200_003, 2048),
                (check_topk, [(1, 4096, 512), (256, 65_536, 512), (6, 1_000_000, 512), (3, 300_000, 2048),
                              (64, 131_072, 512)]),
                (check_attention, 4, 2, 50_000), (check_attention, 2, 1, 1_000_000)]  # fmt: skip
    for check, *args in plan:
        c.run(check, *args)
    return c.failures


# ----------------------------------------------------------------------------------------------- benchmarks


def bench_quantisers(rows: int) -> list[Row]:
    out = []
    x = randn(rows, 512, dtype=torch.bfloat16)
    shape = f"{rows}×512 bf16 ({x.numel() * 2 / GiB:.2f} GiB)"
    for fmt, out_bytes in (("kv_fp4", 288), ("index_fp4", 256 + 16), ("swa_fp8", 528)):
        fn = getattr(kernels, f"quantize_{fmt}")
        ours = median_ms(lambda fn=fn: fn(x, backend="triton"))
        peer = median_ms(lambda fn=fn: fn(x, backend="torch"))
        out.append(Row(f"quantise {fmt}", shape, ours, "torch reference", peer, rows * (1024 + out_bytes)))
    data, scale = kernels.quantize_kv_fp4(x, backend="triton")
    ours = median_ms(lambda: kernels.dequantize_kv_fp4(data, scale, torch.bfloat16, backend="triton"))
    peer = median_ms(lambda: kernels.dequantize_kv_fp4(data, scale, torch.bfloat16, backend="torch"))
    out.append(Row("dequantise kv_fp4", shape, ours, "torch reference", peer, rows * (288 + 1024)))
    return out


def bench_indexer(B: int, T: int, S: int) -> Row:
    case = indexer_inputs(B, T, 32, 128, S, ragged=False)
    ours = median_ms(lambda: kernels.indexer_scores(*case, backend="triton"))
    peer = median_ms(lambda: kernels.indexer_scores(*case, backend="torch"))
    return Row("indexer_scores", f"B={B} T={T} H=32 Di=128 S={S}", ours, "torch reference", peer, B * S * 68,
               {"flops": 2.0 * B * T * 32 * 128 * S})  # fmt: skip


def bench_candidates(B: int, S: int) -> Row:
    scores = randn(B, 1, S)
    n_visible = torch.full((B, 1), S, device=DEVICE)
    ours = median_ms(lambda: kernels.candidate_mask(scores, n_visible, 8, 2048, backend="triton"))
    peer = median_ms(lambda: kernels.candidate_mask(scores, n_visible, 8, 2048, backend="torch"))
    return Row("candidate_mask", f"B={B} S={S} 2048 blocks of 8", ours, "torch reference", peer, B * S * 5)


def bench_topk(R: int, L: int, k: int) -> Row:
    scores = randn(R, L, dtype=torch.bfloat16)
    ours = median_ms(lambda: kernels.topk_indices(scores, k, backend="triton"))
    peer = median_ms(lambda: torch.topk(scores, k, dim=-1))
    return Row("topk_indices", f"R={R} L={L} k={k} bf16", ours, "torch.topk", peer, R * L * 2 + R * k * 4)


def bench_attention(B: int, context: int, dense_budget: int) -> Row:
    H, D, W, K = 64, 512, 128, 512
    case = attention_inputs(B, 1, H, D, W, context, K, ragged=False)
    ours = median_ms(lambda: kernels.sparse_attention(*case, backend="triton"))
    peer = median_ms(lambda: kernels.sparse_attention(*case, backend="torch"))
    row = Row("sparse_attention", f"B={B} ctx={context} H=64 D=512 W=128 K=512", ours, "torch reference", peer,
              B * (W * 528 + K * 288 + 2 * H * D * 2))  # fmt: skip
    # dense SDPA decode, 64 heads × 128 dims, bf16 K = V over the whole context (kept under 2^31 elements per
    # tensor: torch's SDPA kernels index with 32-bit offsets and fault beyond, seen at 1 M tokens on the H200)
    dense_elements = B * context * 64 * 128
    if dense_elements * 2 <= dense_budget and dense_elements < 2**31:
        q = randn(B, 64, 1, 128, dtype=torch.bfloat16)
        kv = randn(B, 64, context, 128, dtype=torch.bfloat16)
        row.extra["dense_sdpa_ms"] = median_ms(lambda: F.scaled_dot_product_attention(q, kv, kv))
    return row


def bench_tuning(tiny: bool) -> list[Row]:
    """Launch shapes of the indexer and attention kernels, side by side (the defaults come from this table)."""
    rows = []
    B, S = (2, 256) if tiny else (64, 65_536)
    case = indexer_inputs(B, 1, 32, 128, S, ragged=False)
    for block_s, warps in [(64, 4), (128, 4), (128, 8), (256, 8)]:
        ms = median_ms(lambda b=block_s, w=warps: indexer.indexer_scores_triton(*case, block_s=b, num_warps=w))
        rows.append(Row("tune indexer", f"B={B} T=1 S={S} block_s={block_s} warps={warps}", ms, "", None,
                        B * S * 68))  # fmt: skip
    for B in [1, 64]:
        case = attention_inputs(B, 1, 64, 512, 128, 4096 if tiny else 65_536, 512, ragged=False)
        for block_n in (16, 32, 64):
            ms = median_ms(lambda b=block_n, c=case: sparse_attn.sparse_attention_triton(*c, block_n=b))
            rows.append(Row("tune attention", f"B={B} block_n={block_n}", ms, "", None, B * (128 * 528 + 512 * 288)))
    return rows


def run_benchmarks(tiny: bool, out_dir: Path) -> dict:
    copy_bytes = 1 << 20 if tiny else 2 * GiB
    copy = copy_bandwidth(copy_bytes)
    print(f"device-to-device copy: {copy / 1e12:.2f} TB/s (read + write, {copy_bytes / GiB:.2f} GiB)", flush=True)
    plan: list[tuple[Callable[..., Row | list[Row]], tuple]] = [(bench_quantisers, (64 if tiny else 1 << 20,))]
    for B, T, S in [(2, 1, 256)] if tiny else [(64, 1, 65_536), (8, 1, 1_048_576), (1, 1024, 65_536)]:
        plan.append((bench_indexer, (B, T, S)))
    plan.append((bench_candidates, (2, 4096) if tiny else (64, 1_048_576)))
    lengths = [512, 2048] if tiny else [4096, 16_384, 65_536, 262_144, 1_048_576]
    plan += [(bench_topk, (R, L, 16 if tiny else 512)) for R in ([1, 6] if tiny else [1, 6, 256]) for L in lengths]
    contexts = [256, 1024] if tiny else [4096, 16_384, 65_536, 262_144, 1_048_576]
    plan += [(bench_attention, (B, ctx, 1 << 20 if tiny else 40 * GiB)) for B in ([1, 2] if tiny else [1, 64, 256])
             for ctx in contexts]  # fmt: skip
    plan.append((bench_tuning, (tiny,)))
    rows: list[Row] = []
    for bench, args in plan:
        try:
            result = bench(*args)
        except Exception as error:  # keep going: report what ran
            detail = f"raised {type(error).__name__}: {error} (cause: {error.__cause__!r})"
            print(f"  {bench.__name__}{args} {detail[-3000:]}", flush=True)
            continue
        rows += result if isinstance(result, list) else [result]
        print(f"  {bench.__name__}{args} done", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(rows, copy)
    result = {"environment": environment(), "copy_bandwidth_Bps": copy,
              "rows": [asdict(r) | {"bandwidth_Bps": r.bandwidth()} for r in rows]}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(result, indent=1))
    plot(rows, out_dir)
    return result


def print_table(rows: list[Row], copy: float) -> None:
    head = f"{'kernel':<20} {'shape':<44} {'ours ms':>9} {'GB/s':>8} {'% copy':>7} {'peer':<16} {'peer ms':>9} {'×':>6}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        speedup = f"{r.peer_ms / r.ours_ms:6.2f}" if r.peer_ms else "     –"
        peer_ms = f"{r.peer_ms:9.4f}" if r.peer_ms else "        –"
        print(f"{r.kernel:<20} {r.shape:<44} {r.ours_ms:9.4f} {r.bandwidth() / 1e9:8.0f} "
              f"{100 * r.bandwidth() / copy:6.1f}% {r.peer:<16} {peer_ms} {speedup}")  # fmt: skip
        if "dense_sdpa_ms" in r.extra:
            dense = r.extra["dense_sdpa_ms"]
            print(f"{'':<20} {'  vs dense SDPA decode (64×128, bf16)':<44} {'':>9} {'':>8} {'':>7} "
                  f"{'dense SDPA':<16} {dense:9.4f} {dense / r.ours_ms:6.2f}")  # fmt: skip
    print(flush=True)


def plot(rows: list[Row], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(kernel: str, key: str) -> dict[int, list[tuple[int, Row]]]:
        groups: dict[int, list[tuple[int, Row]]] = {}
        for r in rows:
            if r.kernel == kernel:
                fields = dict(part.split("=") for part in r.shape.split() if "=" in part)
                groups.setdefault(int(fields[key]), []).append(
                    (int(fields["L" if kernel == "topk_indices" else "ctx"]), r)
                )
        return groups

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for R, points in series("topk_indices", "R").items():
        xs = [x for x, _ in points]
        line = ax.plot(xs, [r.ours_ms for _, r in points], "o-", label=f"ours, batch {R}")[0]
        ax.plot(xs, [r.peer_ms for _, r in points], "x--", color=line.get_color(), label=f"torch.topk, batch {R}")
    ax.set(xscale="log", yscale="log", xlabel="row length", ylabel="ms (median)", title="top-512 of bf16 rows")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "kernels_topk.png", dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for B, points in series("sparse_attention", "B").items():
        xs = [x for x, _ in points]
        line = ax.plot(xs, [r.ours_ms for _, r in points], "o-", label=f"sparse FP4/FP8 (ours), batch {B}")[0]
        dense = [(x, r.extra["dense_sdpa_ms"]) for x, r in points if "dense_sdpa_ms" in r.extra]
        if dense:
            ax.plot(*zip(*dense, strict=True), "x--", color=line.get_color(), label=f"dense SDPA decode, batch {B}")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms (median)",
           title="decode attention, 64 heads: sparse 128 + 512 keys vs dense")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "kernels_attention.png", dpi=120)


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
    parser.add_argument("--check", action="store_true", help="run the correctness checks at real sizes")
    parser.add_argument("--bench", action="store_true", help="with --check: also run the benchmarks")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a CPU smoke run of this script")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")), help="JSON / PNG folder")
    args = parser.parse_args()
    print(json.dumps(environment()), flush=True)
    torch.manual_seed(0)
    failures = run_checks(args.tiny) if args.check else []
    if args.bench or not args.check:
        run_benchmarks(args.tiny, args.out)
    if failures:
        print(f"{len(failures)} check(s) FAILED: {', '.join(failures)}")
        return 1
    return 0


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if __name__ == "__main__":
    sys.exit(main())
