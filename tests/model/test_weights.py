"""The two forms of a model (packed for serving, float for training), seeded init, memory = checkpoint bytes.

The formats do not depend on the vocabulary, so most tests use `narrow` (`tiny` with a 2,048-token vocabulary).
"""

from __future__ import annotations

import pytest
import torch

from model import build_model, model_fingerprint, preset, quant
from model.linear import Fp8Linear, Fp8Rows, Linear
from model.moe import Experts, PackedExperts
from model.weights import checkpoint_views, dequantize_weight, quantize_weight, state_tensors, weight_bytes


def test_packed_form_holds_checkpoint_bytes_only(narrow, narrow_args):
    """Every quantised weight is held as its stored bytes: E4M3 + UE8M0 blocks, E2M1 nibbles; no float copy."""
    C, I = narrow_args.hidden_size, narrow_args.moe_intermediate_size
    wq_a = narrow.layers[0].attn.wq_a
    assert isinstance(wq_a, Fp8Linear)
    assert (wq_a.weight.dtype, wq_a.scale.dtype) == (torch.float8_e4m3fn, torch.uint8)
    assert tuple(wq_a.scale.shape) == (narrow_args.q_lora_rank // 32, C // 32)
    experts = narrow.layers[3].ffn.experts
    assert isinstance(experts, PackedExperts)
    assert (experts.w13.dtype, tuple(experts.w13.shape)) == (torch.uint8, (narrow_args.n_routed_experts, 2 * I, C // 2))
    assert tuple(experts.w2_scale.shape) == (narrow_args.n_routed_experts, C, I // 32)
    assert isinstance(narrow.layers[1].engram.embed, Fp8Rows)
    floats = [n for n, p in narrow.named_parameters() if p.dtype.is_floating_point and p.element_size() > 1]
    assert not [n for n in floats if ".experts." in n or n.endswith(("wq_a.weight", "wo_b.weight", "embed.scale"))]
    for module in narrow.modules():
        assert not (isinstance(module, Linear) and module.quantized), module  # no float-form quantised linear left


def test_packed_and_float_forms_compute_the_same(tiny, tiny_float, tokens):
    """The torch references of the packed kernels dequantise exactly: fp64 logits agree bit for bit."""
    ids = tokens(19).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(tiny(ids), tiny_float(ids))
    experts = tiny_float.layers[2].ffn.experts
    assert isinstance(experts, Experts)
    views = checkpoint_views(tiny)
    for name in ("layers.2.ffn.experts.1.w3", "layers.0.attn.wkv", "mtp.0.main_proj"):
        fmt = "fp4" if ".experts." in name else "fp8"
        decoded = dequantize_weight(views[f"{name}.weight"], views[f"{name}.scale"], fmt, torch.float64)
        assert torch.equal(decoded, tiny_float.get_parameter(f"{name}.weight")), name


def test_a_table_quantised_a_few_million_values_at_a_time_is_the_whole_tables_quantisation():
    """An Engram table beyond one chunk of `fp8_rows` quantisation (≈ 4 M values; here 5.2 M in rows whose amax
    spans 2^±20, some all zero) gives the bytes and scales of the table quantised at once."""
    g = torch.Generator().manual_seed(7)
    table = torch.randn(20_483, 256, generator=g) * torch.exp2(torch.randint(-20, 21, (20_483, 1), generator=g))
    table[::997] = 0.0
    data, scale = quantize_weight(table, "fp8_rows")
    whole, whole_scale = quant.fp8_quant(table, block=32)
    assert torch.equal(data.view(torch.uint8), whole)
    assert torch.equal(scale, whole_scale)


@pytest.mark.parametrize("preset_name", ["tiny", "demo"])
def test_weight_memory_equals_checkpoint_bytes(preset_name):
    """At the released dtype (bf16 plain tensors) a packed model holds exactly its checkpoint's bytes."""
    args = preset(preset_name)
    model = build_model(args, seed=0, dtype=torch.bfloat16)
    stored = sum(t.numel() * t.element_size() for _, t in state_tensors(model))
    assert abs(weight_bytes(model) - stored) <= 0.02 * stored
    assert weight_bytes(model) == stored


def test_seeded_init_is_deterministic(narrow_args, narrow):
    again, other = build_model(narrow_args, seed=0), build_model(narrow_args, seed=1)
    pairs = zip(narrow.state_dict().values(), again.state_dict().values(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)
    assert not torch.equal(narrow.head.weight, other.head.weight)
    assert again.fingerprint == narrow.fingerprint != other.fingerprint
    # A prefill machine (encoder part) and a decode machine (full model) of one seed share weights and fingerprint.
    encoder = build_model(narrow_args, "encoder", seed=0)
    assert encoder.fingerprint == narrow.fingerprint
    assert all(torch.equal(v, narrow.state_dict()[n]) for n, v in encoder.state_dict().items())
    # The float form of the seed holds the values the packed bytes decode to (test_packed_and_float_forms_…).
    assert build_model(narrow_args, seed=0, packed=False).fingerprint == narrow.fingerprint


def test_fingerprint_identifies_config_and_weights(tiny_args):
    w = {"a": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16)}
    fp = model_fingerprint(tiny_args, w)
    assert len(fp) == 16
    assert fp == model_fingerprint(tiny_args, dict(reversed(w.items())))
    assert fp != model_fingerprint(tiny_args.replace(kv_block_tokens=32), w)
    assert fp != model_fingerprint(tiny_args, {**w, "a": torch.arange(4.0) + 1e-7})


def test_expert_scale_block_16(tiny_args, tokens):
    """FP4 experts with a UE8M0 scale per 16 inputs (one reading of the release): packed and float forms agree."""
    args, q = tiny_args, tiny_args.quantization_config
    args16 = args.replace(quantization_config=type(q)(**{**q.__dict__, "expert_scale_block": 16}))
    packed = build_model(args16, seed=0, dtype=torch.float64)
    assert packed.layers[2].ffn.experts.w13_scale.shape[-1] == args.hidden_size // 16
    float_form = build_model(args16, seed=0, dtype=torch.float64, packed=False)
    ids = tokens(11).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(packed(ids), float_form(ids))
    with pytest.raises(ValueError, match="expert_scale_block must be 16 or 32"):
        args.replace(quantization_config=type(q)(**{**q.__dict__, "expert_scale_block": 64}))
