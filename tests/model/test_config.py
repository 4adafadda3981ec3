"""Config: released field names, presets, the CSA2 layer-role table, validation with precise errors."""

from __future__ import annotations

import json

import pytest

from model import PRESETS, ModelArgs, preset
from model.config import Mode


def released_config_json() -> dict:
    """The released config.json shape: nested text_config (40 ratios, unknown keys), top-level quantization."""
    text = {k: v for k, v in ModelArgs().to_dict().items() if k not in ("quantization_config", "kv_block_tokens")}
    text["compress_ratios"] = text["compress_ratios"][:40]
    text |= {"model_type": "deepseek_v41_text", "torch_dtype": "bfloat16", "attention_dropout": 0.0}
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": {"num_hidden_layers": 32, "hidden_size": 1024},
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        },
    }


def test_released_config_json_loads_as_v41_flash(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(released_config_json()))
    assert ModelArgs.from_json(path) == preset("v41-flash")
    out = tmp_path / "again.json"
    preset("tiny").to_json(out)
    assert ModelArgs.from_json(out) == preset("tiny")
    assert preset(str(out)) == preset("tiny")


def test_released_layer_table():
    """Reference §2.2: Full 2/8/14/20, Reindex 24/28/32/36, Reuse the other compressed layers, SWA 0, 1 + DSpark."""
    roles = preset("v41-flash").layer_roles
    modes = [r.mode for r in roles]
    assert [i for i, m in enumerate(modes) if m is Mode.FULL] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m is Mode.REINDEX] == [24, 28, 32, 36]
    assert [i for i, m in enumerate(modes) if m is Mode.SWA] == [0, 1, 40, 41, 42]
    assert modes.count(Mode.REUSE) == 30
    assert [r.layer_id for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.layer_id for r in roles if r.candidate_source] == [20]
    assert [r.layer_id for r in roles if r.engram] == [1, 14]
    assert roles[13].kv_source == 8
    assert roles[13].index_source == 8
    assert roles[27].kv_source == 20
    assert roles[27].index_source == 24
    assert all(r.yarn == (r.ratio > 0) for r in roles)
    assert all(r.encoder == (r.layer_id < 20) for r in roles)


def test_tiny_has_every_mode():
    roles = preset("tiny").layer_roles
    assert {r.mode for r in roles} == set(Mode)
    assert {r.ratio for r in roles if r.mode is Mode.FULL} == {1, 2}
    assert sum(r.engram for r in roles) == 2
    assert len(roles) - preset("tiny").num_hidden_layers == 3
    assert any(r.uses_candidates for r in roles)
    assert any(r.candidate_source for r in roles)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_keep_the_released_vocabulary(name):
    assert preset(name).vocab_size == 129280


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": -1}, "hidden_size must be positive"),
        ({"compress_ratios": (0,) * 10}, "compress_ratios has 10 entries"),
        ({"kv_source_layer_ids": (2, 8, 14, 24)}, "layer 20 needs an earlier kv source with the same compress ratio"),
        ({"candidate_source_layer_id": 24}, "candidate_source_layer_id must be the decoder's KV source"),
        ({"kv_block_tokens": 60}, "kv_block_tokens must be a multiple of"),
        ({"engram_layer_ids": (1, 25)}, "Engram layers must be encoder layers"),
        ({"head_dim": 500}, "head_dim must be a multiple of 32"),
        ({"index_source_layer_ids": (2, 8, 20)}, "kv source 14 must also be an index source"),
    ],
)
def test_invalid_configs_name_the_problem(changes, message):
    with pytest.raises(ValueError, match=message):
        preset("v41-flash").replace(**changes)


def test_wrong_json_types_name_the_field():
    with pytest.raises(ValueError, match="'hidden_size' must be int"):
        ModelArgs.from_dict({"hidden_size": "5120"})
    with pytest.raises(ValueError, match="'compress_ratios' must be a list of integers"):
        ModelArgs.from_dict({"compress_ratios": [0, "2"]})
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("huge")
