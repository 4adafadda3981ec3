"""KV-cache, parameter and decode-FLOP accounting (reference §3), and its CLI.

    python -m model.accounting --preset v41-flash [--json] [--plot FILE.png]

- Global KV bytes per token: every KV-source layer's entry bytes / m (V4.1: FP4 main KV D/2 + D/16, FP4 indexer K
  Dᵢ/2 + Dᵢ/32; V4: the 584-byte FP8-NoPE + BF16-RoPE entry and 68-byte indexer K of each CSA/HCA layer).
- SWA ring bytes per sequence: backbone layers × window × FP8 entry (the DSpark rings separately).
- Parameters, counted on a `meta`-device instantiation (V4.1 presets): total, backbone (= total − Engram − DSpark),
  Engram, DSpark, decode-active (backbone weights one decoded token touches: attention, mHC, norms, gate, shared and
  the top-k routed experts, embedding and head — Engram reported apart, as the paper does) and prefill-active
  (embedding, layers 0..L/2−1 with top-k experts, layer L/2's KV projections).
- Weight bytes at native precision (the packed model on `meta`: FP8 and FP4 weights as their checkpoint bytes):
  the GPU bytes one rank holds for each expert-parallel size (routed experts — DSpark's too — split over the ranks,
  everything else replicated), one prefill replica's encoder half, and the Engram tables, which live in host memory.
- Single-token decode FLOPs against context length (4 K … 1 M): matmuls (2 per weight) + attention core (4·H·D per
  key: window + selected entries, or all HCA entries in V4) + indexer scoring (2·Hᵢ·Dᵢ per scored position).
  Precision weighting, in FP8-equivalent FLOPs (the relative tensor-core rates): FP8 MMA ×1 (FP8 weights, and the
  FP4 routed experts whose inputs are FP8), BF16 MMA ×2 (BF16 weights, head, mHC, and the attention core, which
  runs on BF16 MMA after dequantising the KV), FP4×FP4 MMA ×0.5 (indexer q·K).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field

import torch

from model.config import V4, ModelArgs, preset
from model.kv import entry_widths, kv_sources

CONTEXTS = tuple(4096 * 2**i for i in range(9))  # 4 K … 1 M
EP_SIZES = (1, 2, 4, 8)
WEIGHT = {"fp8": 1.0, "bf16": 2.0, "fp4": 0.5}


# ------------------------------------------------------------------------------------------------------ KV
def _v4_entry_bytes(args: ModelArgs) -> int:
    """V4 cache entry: FP8 NoPE dims + BF16 RoPE dims + one UE8M0 scale per 64 NoPE dims, padded by one byte."""
    nope = args.head_dim - args.qk_rope_head_dim
    return nope + 2 * args.qk_rope_head_dim + nope // 64 + 1


def kv_breakdown(args: ModelArgs) -> list[dict[str, float]]:
    """Per KV-source layer: bytes per token of main KV and indexer K."""
    if args.model_type == V4:
        main = _v4_entry_bytes(args)
        index = args.index_head_dim // 2 + args.index_head_dim // 32
        return [
            {
                "layer": s,
                "ratio": m,
                "main_kv": main / m,
                "index_k": index / m if s in args.index_source_layer_ids else 0,
            }
            for s in args.kv_source_layer_ids
            if (m := args.compress_ratios[s])
        ]
    D2, D16, Di2, Di32 = entry_widths(args)
    return [
        {"layer": s, "ratio": m, "main_kv": (D2 + D16) / m, "index_k": (Di2 + Di32) / m} for s, m in kv_sources(args)
    ]


def swa_entry_bytes(args: ModelArgs) -> int:
    return _v4_entry_bytes(args) if args.model_type == V4 else args.head_dim + args.head_dim // 32


# -------------------------------------------------------------------------------------------------- params
def parameter_counts(args: ModelArgs) -> dict[str, int]:
    """Parameter categories of a V4.1 model instantiated on the meta device (no memory, no init)."""
    from model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    L2, k, E = args.n_encoder_layers, args.num_experts_per_tok, args.n_routed_experts
    counts = {"total": 0, "engram": 0, "dspark": 0, "decode_active": 0.0, "prefill_active": 0.0}
    projection = re.compile(rf"layers\.{L2}\.(attn_norm\.|attn\.compressor\.|attn\.indexer\.(wk|k_norm)\.)")
    for name, p in model.named_parameters():
        n = p.numel()
        counts["total"] += n
        layer = int(m.group(1)) if (m := re.match(r"layers\.(\d+)\.", name)) else None
        if name.startswith("mtp."):
            counts["dspark"] += n
            continue
        if ".engram." in name:
            counts["engram"] += n
            continue
        active = n * k / E if ".ffn.experts." in name else n
        counts["decode_active"] += active
        if name.startswith("embed.") or (layer is not None and layer < L2) or projection.match(name):
            counts["prefill_active"] += active
    counts["backbone"] = counts["total"] - counts["engram"] - counts["dspark"]
    return {key: round(v) for key, v in counts.items()}


# --------------------------------------------------------------------------------------------- weight bytes
def _weight_split(args: ModelArgs, part: str) -> dict[str, int]:
    """Bytes of a packed model part by placement: routed experts, Engram tables (host) and the rest."""
    from model.linear import Fp8Rows
    from model.moe import PackedExperts
    from model.weights import build_model, weight_bytes

    model = build_model(args, part, seed=None, device="meta")
    routed = sum(weight_bytes(m) for m in model.modules() if isinstance(m, PackedExperts))
    engram = sum(weight_bytes(m) for m in model.modules() if isinstance(m, Fp8Rows))
    return {"routed": routed, "engram": engram, "rest": weight_bytes(model) - routed - engram}


def native_weight_bytes(args: ModelArgs) -> dict[str, object]:
    """GPU weight bytes per rank for each expert-parallel size, the encoder half's, and the Engram host bytes."""
    full, encoder = _weight_split(args, "full"), _weight_split(args, "encoder")
    return {
        "per_device": {str(w): -(-full["routed"] // w) + full["rest"] for w in EP_SIZES},
        "routed": full["routed"],
        "replicated": full["rest"],
        "encoder_half": encoder["routed"] + encoder["rest"],
        "engram_host": full["engram"],
    }


# --------------------------------------------------------------------------------------------------- FLOPs
def _matmul_params(args: ModelArgs) -> dict[str, float]:
    """Weights one decoded token multiplies with, by MMA precision (analytic; cross-checked against `meta`)."""
    C, H, D, q, R, G = (args.hidden_size, args.num_attention_heads, args.head_dim, args.q_lora_rank, args.o_lora_rank,
                        args.o_groups)  # fmt: skip
    Hi, Di, I, n = args.index_n_heads, args.index_head_dim, args.moe_intermediate_size, args.hc_mult
    p = {"fp8": 0.0, "bf16": 0.0}
    for layer in range(args.num_hidden_layers):
        m = args.compress_ratios[layer]
        p["fp8"] += C * q + q * H * D + C * D + G * R * C  # wq_a, wq_b, wkv, wo_b
        p["bf16"] += H * D * R + 2 * (2 + n) * n * n * C  # wo_a (block-diagonal), the two mHC projections
        p["bf16"] += C * args.n_routed_experts  # gate
        p["fp8"] += 3 * C * I * (args.num_experts_per_tok + args.n_shared_experts)
        if layer in args.kv_source_layer_ids:
            width = (2 * D if m == 4 else D) if args.model_type == V4 else D  # V4 CSA overlaps: 2c channels
            p["bf16"] += C * width * (2 if m > 1 else 1)  # wkv (+ wgate)
            p["bf16"] += D * Di if args.model_type != V4 else 0  # indexer wk on the latent
        if layer in args.index_source_layer_ids:
            p["fp8"] += q * Hi * Di
            p["bf16"] += C * Hi + (
                2 * C * 2 * Di if args.model_type == V4 else 0
            )  # weights_proj (+ V4's own compressor)
        if layer in args.engram_layer_ids:
            p["fp8"] += len(args.engram_orders) * args.engram_n_heads * args.engram_head_dim * (n + 1) * C
    p["bf16"] += C * args.vocab_size  # head
    return p


def decode_flops(args: ModelArgs, context: int) -> dict[str, float]:
    """FLOPs of one decoded token after `context` tokens: raw and FP8-weighted, by component."""
    H, D, W = args.num_attention_heads, args.head_dim, args.sliding_window
    Hi, Di = args.index_n_heads, args.index_head_dim
    mm = _matmul_params(args)
    keys = scored = 0.0
    pool = args.candidate_topk_blocks * args.candidate_block_size
    for layer in range(args.num_hidden_layers):
        m = args.compress_ratios[layer]
        keys += min(W, context)
        if not m:
            continue
        visible = context // m
        hca = args.model_type == V4 and m > 4  # V4 HCA attends every compressed entry (no indexer)
        keys += visible if hca else min(args.index_topk, visible)
        if layer in args.index_source_layer_ids:
            uses_pool = args.model_type != V4 and 0 <= args.candidate_source_layer_id < layer
            scored += min(pool, visible) if uses_pool else visible
    parts = {
        "matmul": 2 * (mm["fp8"] + mm["bf16"]),
        "attention": 4 * H * D * keys,
        "indexer": 2 * Hi * (Di + 1) * scored,
    }
    weighted = 2 * (WEIGHT["fp8"] * mm["fp8"] + WEIGHT["bf16"] * mm["bf16"])
    weighted += WEIGHT["bf16"] * parts["attention"] + WEIGHT["fp4"] * parts["indexer"]
    return {**parts, "raw": sum(parts.values()), "weighted": weighted}


# ------------------------------------------------------------------------------------------------- report
@dataclass
class Report:
    preset: str
    global_kv_bytes_per_token: float
    kv_breakdown: list[dict[str, float]]
    main_kv_bytes_per_token: float
    index_k_bytes_per_token: float
    swa_ring_bytes_per_sequence: int
    dspark_ring_bytes_per_sequence: int
    params_total: int | None = None
    params_backbone: int | None = None
    params_engram: int | None = None
    params_dspark: int | None = None
    params_decode_active: int | None = None
    params_prefill_active: int | None = None
    weight_bytes_per_device: dict[str, int] | None = None  # expert-parallel size → GPU weight bytes of one rank
    weight_bytes_routed: int | None = None  # every routed expert (split over the ranks)
    weight_bytes_replicated: int | None = None  # the rest of the GPU weights (on every rank)
    weight_bytes_encoder_half: int | None = None  # one prefill replica (EP 1)
    engram_host_bytes: int | None = None  # the Engram tables, in host memory
    decode_flops: dict[int, dict[str, float]] = field(default_factory=dict)
    flop_weighting: str = "FP8-equivalent: FP8 MMA x1, BF16 MMA x2, FP4xFP4 MMA x0.5"


def account(name: str, args: ModelArgs | None = None) -> Report:
    args = args or preset(name)
    breakdown = kv_breakdown(args)
    main = sum(b["main_kv"] for b in breakdown)
    index = sum(b["index_k"] for b in breakdown)
    ring = args.sliding_window * swa_entry_bytes(args)
    report = Report(
        preset=name,
        global_kv_bytes_per_token=main + index,
        kv_breakdown=breakdown,
        main_kv_bytes_per_token=main,
        index_k_bytes_per_token=index,
        swa_ring_bytes_per_sequence=args.num_hidden_layers * ring,
        dspark_ring_bytes_per_sequence=args.num_nextn_predict_layers * ring if args.is_v41 else 0,
        decode_flops={n: decode_flops(args, n) for n in CONTEXTS},
    )
    if args.is_v41:  # V4-Flash has no V4.1 module tree to instantiate: KV and FLOPs only
        counts = parameter_counts(args)
        for key in ("total", "backbone", "engram", "dspark", "decode_active", "prefill_active"):
            setattr(report, f"params_{key}", counts[key])
        if args.quantization_config is not None:
            w = native_weight_bytes(args)
            report.weight_bytes_per_device, report.weight_bytes_routed = w["per_device"], w["routed"]
            report.weight_bytes_replicated, report.weight_bytes_encoder_half = w["replicated"], w["encoder_half"]
            report.engram_host_bytes = w["engram_host"]
    return report


def _gib(n: int) -> str:
    return f"{n / 2**30:>10,.2f} GiB"


def _render_weights(r: Report) -> list[str]:
    if r.weight_bytes_per_device is None:
        return []
    header = f"  {'expert-parallel size':>20} {'routed experts':>14} {'replicated':>14} {'GPU per rank':>14}"
    lines = ["", "weights at native precision (FP8 / packed FP4 as stored; Engram tables in host memory)", header]
    for w, total in r.weight_bytes_per_device.items():
        routed = -(-r.weight_bytes_routed // int(w))
        lines.append(f"  {w:>20} {_gib(routed)} {_gib(r.weight_bytes_replicated)} {_gib(total)}")
    lines += [
        f"  encoder half (one prefill replica, EP 1) {_gib(r.weight_bytes_encoder_half).strip()}",
        f"  Engram tables (host memory)              {_gib(r.engram_host_bytes).strip()}",
    ]
    return lines


def _fmt_params(n: int | None) -> str:
    return "n/a (accounting-only preset)" if n is None else f"{n / 1e9:,.3f} B ({n:,})"


def render(r: Report) -> str:
    lines = [f"model accounting: {r.preset}", "", "global KV per token (bytes)"]
    lines += [f"  layer {b['layer']:>3} m={b['ratio']:<3} main KV {b['main_kv']:>9.3f}   indexer K {b['index_k']:>8.3f}"
              for b in r.kv_breakdown]  # fmt: skip
    lines += [
        f"  total main KV {r.main_kv_bytes_per_token:,.2f} + indexer K {r.index_k_bytes_per_token:,.2f}"
        f" = {r.global_kv_bytes_per_token:,.2f} B/token",
        f"SWA rings per sequence: {r.swa_ring_bytes_per_sequence:,} B"
        f" (+ DSpark {r.dspark_ring_bytes_per_sequence:,} B; volatile, never persisted)",
        "",
        "parameters",
    ]
    for key in ("total", "backbone", "engram", "dspark", "decode_active", "prefill_active"):
        lines.append(f"  {key:<15} {_fmt_params(getattr(r, f'params_{key}'))}")
    lines += _render_weights(r)
    columns = ("matmul", "attention", "indexer", "raw", "weighted")
    header = " ".join(f"{c:>10}" for c in columns)
    lines += ["", f"single-token decode FLOPs ({r.flop_weighting})", f"  {'context':>9} {header} {'vs 4K':>7}"]
    base = r.decode_flops[CONTEXTS[0]]["weighted"]
    for n, f in r.decode_flops.items():
        g = [f"{f[k] / 1e9:>9.3f}G" for k in columns]
        lines.append(f"  {n:>9,} {' '.join(g)} {f['weighted'] / base:>6.2f}x")
    return "\n".join(lines)


def plot(path: str) -> None:
    """Bytes/token of accumulated global KV and decode FLOPs vs context, V4-Flash against V4.1-Flash."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # matplotlib is a dev dependency, not one of the model's
        raise SystemExit(f"--plot needs matplotlib ({exc})") from exc
    fig, (ax_kv, ax_fl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in ("v4-flash", "v41-flash"):
        args = preset(name)
        r = Report(name, sum(b["main_kv"] + b["index_k"] for b in kv_breakdown(args)), [], 0, 0, 0, 0)
        ctx = list(CONTEXTS)
        ax_kv.plot(ctx, [r.global_kv_bytes_per_token * n / 2**30 for n in ctx], marker="o",
                   label=f"{name}: {r.global_kv_bytes_per_token:,.2f} B/token")  # fmt: skip
        ax_fl.plot(ctx, [decode_flops(args, n)["weighted"] / 1e9 for n in ctx], marker="o", label=name)
    for ax, title, unit in (
        (ax_kv, "global KV per sequence", "GiB"),
        (ax_fl, "decode FLOPs per token", "GFLOP (FP8-eq.)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.accounting", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="v41-flash", help="preset name (v41-flash, v4-flash, tiny, small) or config.json"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw bytes/token and FLOPs vs context for V4 and V4.1")
    ns = parser.parse_args(argv)
    try:
        report = account(ns.preset)
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps(asdict(report), indent=2) if ns.json else render(report))
    if ns.plot:
        plot(ns.plot)
        print(f"plot written to {ns.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
