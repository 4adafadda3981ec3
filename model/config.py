"""One typed configuration for the model, with the released `config.json` field names (reference §2.1).

`ModelArgs` is what DeepSeek's `inference/model.py` calls ModelArgs, but its fields are spelled as in the released
`config.json` (`hidden_size`, not `dim`), so a released config file loads without a translation table. Five presets:

| preset      | what                                                                                       |
|-------------|--------------------------------------------------------------------------------------------|
| `v41-flash` | the released DeepSeek-V4.1-Flash text backbone (instantiate on `meta`: accounting only)    |
| `v4-flash`  | the V4-Flash baseline, only what accounting needs (CSA m=4 + HCA m=128, 584-byte FP8 KV)   |
| `tiny`      | every mode present at a size the CPU test-suite runs in seconds                           |
| `small`     | a GPU-sized model (~0.25 B parameters, embeddings dominate) for benchmarks and training    |
| `demo`      | the trained demo checkpoint's shape (hidden 64, ≤ 48 MB stored; model/checkpoints/v41-demo) |

`layer_roles` derives each layer's CSA2 mode (SWA-only / Full / Reindex / Reuse, reference §2.2) from the sharing
lists, exactly as the reference does: `kv_source = max(kv source ≤ layer)`, `index_source = max(index source ≤
layer)`, `uses_candidates = 0 ≤ candidate_source_layer_id < layer` for index sources.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

V41 = "deepseek_v41"
V4 = "deepseek_v4"


@dataclass(frozen=True)
class RopeScaling:
    """YaRN frequency interpolation; applies only to layers with compress ratio > 0 (reference §2.3)."""

    rope_type: str = "yarn"
    factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 65536


@dataclass(frozen=True)
class QuantizationConfig:
    """Checkpoint storage: FP8 weights in 32×32 blocks with UE8M0 scales, routed experts packed FP4."""

    quant_method: str = "fp8"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    # Not in the released config: inputs per UE8M0 scale of the FP4 experts (32, or 16 as one source reads the
    # release, reference §2.9). A checkpoint's scale shapes decide it at load (model.checkpoint).
    expert_scale_block: int = 32


class Mode(enum.Enum):
    """CSA2 mode of a layer (reference §2.2)."""

    SWA = "swa"  # sliding window only
    FULL = "full"  # owns main KV + indexer K (KV source) and its own Top-K (index source)
    REINDEX = "reindex"  # own indexer queries over a borrowed indexer K, own Top-K
    REUSE = "reuse"  # borrows main KV and Top-K indices


@dataclass(frozen=True)
class LayerRole:
    """What one layer owns and borrows. DSpark layers (id ≥ num_hidden_layers) are SWA-only."""

    layer_id: int
    ratio: int  # compress ratio m (0 = SWA only)
    mode: Mode
    kv_source: int | None  # layer whose compressed KV (and indexer K) this layer reads
    index_source: int | None  # layer whose Top-K indices this layer attends with
    candidate_source: bool  # scores the whole range and publishes the block candidate pool
    uses_candidates: bool  # scores only inside the candidate pool (Reindex after the candidate source)
    engram: bool
    dspark_tap: bool  # the hc-mean of the stream entering this layer feeds DSpark
    encoder: bool  # layer < L/2 (CED encoder)

    @property
    def owns_kv(self) -> bool:
        return self.kv_source == self.layer_id

    @property
    def owns_index_query(self) -> bool:
        return self.index_source == self.layer_id

    @property
    def yarn(self) -> bool:
        """Compressed-ratio layers use compress_rope_theta with YaRN; ratio-0 layers rope_theta without it."""
        return self.ratio > 0


@dataclass(frozen=True)
class ModelArgs:
    """The text backbone of DeepSeek-V4.1-Flash; defaults are the released values (reference §2.1)."""

    model_type: str = V41
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    attention_bias: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    compress_rope_theta: float = 160000.0
    sliding_window: int = 128
    # 40 backbone layers + the 3 SWA-only DSpark layers, as the reference ModelArgs spells it.
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    quantization_config: QuantizationConfig | None = field(default_factory=QuantizationConfig)
    # Serving extension (not in the released config): tokens per global KV block of the prefix cache. A multiple
    # of every compress ratio and of candidate_block_size, so blocks hold whole entries and whole pool blocks.
    kv_block_tokens: int = 64

    def __post_init__(self) -> None:
        _validate(self)

    # ----------------------------------------------------------------------------------------------- derived
    @property
    def n_encoder_layers(self) -> int:
        """L/2: layers 0..L/2−1 are the CED encoder; layer L/2 is the decoder's (only) global-KV source."""
        return self.num_hidden_layers // 2

    @property
    def n_layers_total(self) -> int:
        """Backbone layers plus DSpark (mtp) layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def engram_orders(self) -> tuple[int, ...]:
        """N-gram orders hashed by Engram: 2..engram_max_ngram_size."""
        return tuple(range(2, self.engram_max_ngram_size + 1))

    @cached_property
    def layer_roles(self) -> tuple[LayerRole, ...]:
        return tuple(_role(self, i) for i in range(self.n_layers_total))

    def role(self, layer_id: int) -> LayerRole:
        return self.layer_roles[layer_id]

    @property
    def is_v41(self) -> bool:
        return self.model_type == V41

    # ------------------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists); `from_dict(to_dict())` is the identity."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelArgs:
        """From a flat dict or a released config.json (`text_config` nested, `quantization_config` at the top).

        Keys this model does not use (vision tower, torch_dtype, …) are ignored; a known key with a wrong type is a
        ValueError naming it.
        """
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a JSON object, got {type(data).__name__}")
        flat = dict(data.get("text_config", {})) if "text_config" in data else dict(data)
        if "text_config" in data:
            flat.setdefault("quantization_config", data.get("quantization_config"))
            if "model_type" in data and "model_type" not in flat:
                flat["model_type"] = data["model_type"]
        if flat.get("model_type", V41).startswith(V41):  # "deepseek_v41_text" in some exports
            flat["model_type"] = V41
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in flat:
                kwargs[f.name] = _coerce(f.name, f.type, flat[f.name])
        # The released compress_ratios may omit the trailing DSpark zeros (HF keeps 43 entries, some exports 40).
        ratios = kwargs.get("compress_ratios")
        layers = kwargs.get("num_hidden_layers", cls.num_hidden_layers)
        mtp = kwargs.get("num_nextn_predict_layers", cls.num_nextn_predict_layers)
        if ratios is not None and len(ratios) == layers:
            kwargs["compress_ratios"] = (*ratios, *(0,) * mtp)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> ModelArgs:
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data)

    def to_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------------- roles
def _latest(sources: tuple[int, ...], layer: int) -> int | None:
    earlier = [s for s in sources if s <= layer]
    return max(earlier) if earlier else None


def _role(a: ModelArgs, i: int) -> LayerRole:
    ratio = a.compress_ratios[i]
    backbone = i < a.num_hidden_layers
    kv_source = _latest(a.kv_source_layer_ids, i) if ratio and backbone else None
    index_source = _latest(a.index_source_layer_ids, i) if ratio and backbone else None
    is_index = i in a.index_source_layer_ids
    if not ratio or not backbone:
        mode = Mode.SWA
    elif i in a.kv_source_layer_ids:
        mode = Mode.FULL
    elif is_index:
        mode = Mode.REINDEX
    else:
        mode = Mode.REUSE
    return LayerRole(
        layer_id=i,
        ratio=ratio if backbone else 0,
        mode=mode,
        kv_source=kv_source,
        index_source=index_source,
        candidate_source=i == a.candidate_source_layer_id,
        uses_candidates=is_index and 0 <= a.candidate_source_layer_id < i,
        engram=i in a.engram_layer_ids,
        dspark_tap=i in a.dspark_target_layer_ids,
        encoder=i < a.n_encoder_layers,
    )


# ----------------------------------------------------------------------------------------------- validation
def _coerce(name: str, tp: Any, value: Any) -> Any:
    """JSON value → field value; raise ValueError naming the field on a type mismatch."""
    tp = str(tp)
    if name == "rope_scaling":
        return _nested(RopeScaling, name, value)
    if name == "quantization_config":
        return None if value is None else _nested(QuantizationConfig, name, value)
    if tp.startswith("tuple"):
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ValueError(f"config field {name!r} must be a list of integers, got {value!r}")
        return tuple(value)
    expected = {"int": int, "float": (int, float), "bool": bool, "str": str}[tp]
    if (isinstance(value, bool) and tp != "bool") or not isinstance(value, expected):
        raise ValueError(f"config field {name!r} must be {tp}, got {value!r}")
    return float(value) if tp == "float" else value


def _nested(cls: type, name: str, value: Any) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"config field {name!r} must be an object, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in value.items() if k in known}
    return cls(**kwargs)


def _validate(a: ModelArgs) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"invalid model config: {message}")

    need(a.model_type in (V41, V4), f"model_type must be {V41!r} or {V4!r}, got {a.model_type!r}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                 "o_lora_rank", "o_groups", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                 "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
                 "kv_block_tokens"):  # fmt: skip
        need(getattr(a, name) > 0, f"{name} must be positive, got {getattr(a, name)}")
    need(a.num_key_value_heads == 1, "num_key_value_heads must be 1 (one shared K=V latent)")
    need(a.n_shared_experts == 1, "n_shared_experts must be 1")
    need(a.num_attention_heads % a.o_groups == 0, "num_attention_heads must be divisible by o_groups")
    need(a.num_experts_per_tok <= a.n_routed_experts, "num_experts_per_tok exceeds n_routed_experts")
    need(a.qk_rope_head_dim % 2 == 0 and 0 < a.qk_rope_head_dim <= min(a.head_dim, a.index_head_dim),
         "qk_rope_head_dim must be even and fit in head_dim and index_head_dim")  # fmt: skip
    need(len(a.compress_ratios) == a.n_layers_total,
         f"compress_ratios has {len(a.compress_ratios)} entries, expected num_hidden_layers + "
         f"num_nextn_predict_layers = {a.n_layers_total}")  # fmt: skip
    if a.model_type == V4:
        return  # accounting-only preset: the V4.1 sharing rules below do not apply
    # The packed formats: FP8 ring and UE8M0 scales per 32, E4M3 scales per 16, FP8 activations per 32.
    for name in ("hidden_size", "head_dim", "index_head_dim", "q_lora_rank", "moe_intermediate_size"):
        need(getattr(a, name) % 32 == 0, f"{name} must be a multiple of 32 (FP8/FP4 block), got {getattr(a, name)}")
    need(a.scoring_func == "sqrtsoftplus", f"scoring_func must be 'sqrtsoftplus', got {a.scoring_func!r}")
    need(a.hidden_act == "silu", f"hidden_act must be 'silu', got {a.hidden_act!r}")
    need(a.num_hidden_layers % 2 == 0, "num_hidden_layers must be even (CED splits it in half)")
    need(set(a.compress_ratios) <= {0, 1, 2}, "compress_ratios must be 0, 1 or 2 (CSA2)")
    need(all(r == 0 for r in a.compress_ratios[a.num_hidden_layers :]), "DSpark layers must be SWA-only (ratio 0)")
    L2 = a.n_encoder_layers
    for s in a.kv_source_layer_ids:
        need(0 <= s < a.num_hidden_layers and a.compress_ratios[s] > 0, f"kv source {s} must be a compressed layer")
        need(s in a.index_source_layer_ids, f"kv source {s} must also be an index source")
    for s in a.index_source_layer_ids:
        need(0 <= s < a.num_hidden_layers and a.compress_ratios[s] > 0, f"index source {s} must be a compressed layer")
    for i in range(a.num_hidden_layers):
        if a.compress_ratios[i]:
            src = _latest(a.kv_source_layer_ids, i)
            need(src is not None and a.compress_ratios[src] == a.compress_ratios[i],
                 f"layer {i} needs an earlier kv source with the same compress ratio")  # fmt: skip
            need(_latest(a.index_source_layer_ids, i) is not None, f"layer {i} needs an earlier index source")
            need((src >= L2) == (i >= L2), f"layer {i} must read a kv source on its own side of the CED split")
    need(L2 in a.kv_source_layer_ids and a.compress_ratios[L2] == 1,
         f"layer L/2 = {L2} must be the decoder's KV source with ratio 1 (CED)")  # fmt: skip
    need(all(s <= L2 or s not in a.kv_source_layer_ids for s in range(L2 + 1, a.num_hidden_layers)),
         "the decoder must have exactly one KV source, layer L/2")  # fmt: skip
    c = a.candidate_source_layer_id
    if c >= 0:
        need(c == L2, f"candidate_source_layer_id must be the decoder's KV source {L2}, got {c}")
        need(a.candidate_block_size > 0 and a.candidate_topk_blocks > 0, "candidate pool sizes must be positive")
    for r in set(a.compress_ratios) - {0}:
        need(a.kv_block_tokens % r == 0, f"kv_block_tokens must be a multiple of compress ratio {r}")
    if c >= 0:
        need(
            a.kv_block_tokens % a.candidate_block_size == 0,
            "kv_block_tokens must be a multiple of candidate_block_size",
        )
    need(len(a.engram_layer_ids) == len(a.engram_num_embeddings), "engram_layer_ids and engram_num_embeddings differ")
    need(all(0 <= e < L2 for e in a.engram_layer_ids), "Engram layers must be encoder layers (prefill needs them)")
    need(a.engram_max_ngram_size >= 2, "engram_max_ngram_size must be at least 2")
    need(a.engram_head_dim % 32 == 0, "engram_head_dim must be a multiple of 32 (FP8 row scales)")
    need(len(a.dspark_target_layer_ids) > 0 and all(0 <= t < a.num_hidden_layers for t in a.dspark_target_layer_ids),
         "dspark_target_layer_ids must be backbone layers")  # fmt: skip
    need(all(t >= L2 for t in a.dspark_target_layer_ids), "DSpark targets must be decoder layers")
    need(a.num_nextn_predict_layers > 0 and a.dspark_block_size > 0, "DSpark needs layers and a block size")
    need(0 <= a.dspark_noise_token_id < a.vocab_size, "dspark_noise_token_id must be a token id")
    need(a.dspark_num_experts_per_tok <= a.dspark_n_routed_experts, "DSpark experts per token exceed its experts")
    need(a.rope_scaling.rope_type == "yarn", f"rope_scaling.rope_type must be 'yarn', got {a.rope_scaling.rope_type!r}")
    q = a.quantization_config
    if q is not None:
        need(q.expert_dtype == "fp4", f"quantization_config.expert_dtype must be 'fp4', got {q.expert_dtype!r}")
        need(q.expert_scale_block in (16, 32),
             f"quantization_config.expert_scale_block must be 16 or 32, got {q.expert_scale_block}")  # fmt: skip
        need(tuple(q.weight_block_size) == (32, 32),
             f"quantization_config.weight_block_size must be [32, 32], got {list(q.weight_block_size)}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- presets
V41_FLASH = ModelArgs()

# V4-Flash (reference §1.1): 2 SWA, 21 CSA (m=4, own indexer), 20 HCA (m'=128), one MTP layer; FP8 584-byte KV.
V4_FLASH = ModelArgs(
    model_type=V4,
    hidden_size=4096,
    num_hidden_layers=43,
    q_lora_rank=1024,
    o_lora_rank=1024,
    compress_ratios=(0, 0, *(4, 128) * 20, 4, 0),
    kv_source_layer_ids=tuple(i for i in range(43) if i >= 2),
    index_source_layer_ids=tuple(range(2, 43, 2)),
    candidate_source_layer_id=-1,
    index_n_heads=64,
    n_routed_experts=256,
    moe_intermediate_size=2048,
    rms_norm_eps=1e-6,
    engram_layer_ids=(),
    engram_num_embeddings=(),
    num_nextn_predict_layers=1,
    dspark_target_layer_ids=(),
    rope_scaling=RopeScaling(factor=16.0, original_max_position_embeddings=65536),
    quantization_config=QuantizationConfig(weight_block_size=(128, 128)),
)

# Every CSA2 mode at CPU-test size (reference §8 topology, smaller dims): L0 SWA | L1 SWA+Engram | L2 Full m=2 |
# L3 Reuse m=2 +Engram | L4 Full m=1 (CED source, candidate source) | L5 Reuse | L6 Reindex | L7 Reuse | 3 DSpark.
TINY = ModelArgs(
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=2,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_lora_rank=32,
    o_groups=2,
    sliding_window=8,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0),
    kv_source_layer_ids=(2, 4),
    index_source_layer_ids=(2, 4, 6),
    candidate_source_layer_id=4,
    candidate_topk_blocks=3,
    candidate_block_size=4,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=6,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    engram_layer_ids=(1, 3),
    engram_num_embeddings=(3144, 3424),
    engram_max_ngram_size=4,
    engram_vocab_size=500,
    engram_n_heads=2,
    engram_head_dim=32,
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=32,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
    max_position_embeddings=4096,
    rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=256),
    kv_block_tokens=16,
)

# GPU-sized (~0.29 B parameters): released head_dim, index dims and window; 12 layers (6 encoder); the embedding,
# head and Markov head are more than half of it.
SMALL = ModelArgs(
    hidden_size=512,
    num_hidden_layers=12,
    num_attention_heads=8,
    q_lora_rank=256,
    o_lora_rank=256,
    o_groups=4,
    compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0),
    kv_source_layer_ids=(2, 4, 6),
    index_source_layer_ids=(2, 4, 6, 8, 10),
    candidate_source_layer_id=6,
    candidate_topk_blocks=128,
    index_n_heads=8,
    index_topk=128,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=384,
    engram_layer_ids=(1, 4),
    engram_num_embeddings=(96708, 98016),
    engram_vocab_size=8000,
    engram_n_heads=4,
    engram_head_dim=64,
    dspark_target_layer_ids=(9, 10, 11),
    dspark_markov_rank=64,
    dspark_n_routed_experts=8,
    dspark_num_experts_per_tok=2,
    max_position_embeddings=262144,
    rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=65536),
)

# The trained demo checkpoint (model/checkpoints/v41-demo, train/): every mode of TINY at hidden 64, so that the
# released bf16 embedding and head (2 × 129,280 × 64) plus FP8/FP4 layers and DSpark fit in 48 MB. index_topk and
# the candidate pool cover 1,024 positions: at the demo's lengths Top-K keeps every visible entry.
DEMO = ModelArgs(
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=128,
    qk_rope_head_dim=32,
    q_lora_rank=64,
    o_lora_rank=64,
    o_groups=2,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0),
    kv_source_layer_ids=(2, 4),
    index_source_layer_ids=(2, 4, 6),
    candidate_source_layer_id=4,
    candidate_topk_blocks=128,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=1024,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    engram_layer_ids=(1, 3),
    engram_num_embeddings=(24064, 24336),
    engram_vocab_size=4000,
    engram_n_heads=2,
    engram_head_dim=32,
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=16,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
    max_position_embeddings=16384,
    rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=65536),
)

PRESETS: dict[str, ModelArgs] = {
    "v41-flash": V41_FLASH,
    "v4-flash": V4_FLASH,
    "tiny": TINY,
    "small": SMALL,
    "demo": DEMO,
}


def preset(name: str) -> ModelArgs:
    """A preset by name, or a config.json path."""
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json") and os.path.exists(name):
        return ModelArgs.from_json(name)
    raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} or a config.json path")
