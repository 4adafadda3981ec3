"""train.qat: the main-KV precision switch is the model's own (nothing swapped), stored-format weights snap with a
straight-through gradient and bake into plain weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model import Transformer, quant
from model.linear import Linear
from model.weights import dequantize_weight, quantize_weight
from train import qat


def test_main_kv_switches_the_dense_path_without_swapping_the_quantiser(tiny: Transformer) -> None:
    ids = torch.randint(0, tiny.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    fp4 = quant.fake_quant_fp4_e4m3
    owner = tiny.layers[tiny.args.n_encoder_layers].attn.compressor.wkv.weight  # writes the decoder's main KV
    logits = {}
    for fmt in ("fp4", "bf16"):
        with qat.main_kv(fmt):
            assert quant.fake_quant_fp4_e4m3 is fp4
            logits[fmt] = tiny(ids)
            logits[fmt][0, -1].logsumexp(-1).backward()  # straight through the rounding, whichever it is
        assert owner.grad is not None
        assert bool(owner.grad.abs().sum() > 0)
        tiny.zero_grad(set_to_none=True)
    with torch.no_grad():
        default = tiny(ids)
    assert torch.equal(default, logits["fp4"].detach())  # FP4 outside any block: the released QAT
    assert not torch.allclose(default, logits["bf16"].detach())
    with pytest.raises(ValueError, match="'fp4' or 'bf16'"), qat.main_kv("fp8"):  # type: ignore[arg-type]
        pass


def test_stored_weights_snap_with_a_straight_through_gradient_and_bake() -> None:
    layer = Linear(64, 64, "fp8")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)))  # off the FP8 grid
    raw = layer.weight.detach().clone()
    snapped = dequantize_weight(*quantize_weight(raw, "fp8"), "fp8", raw.dtype)
    assert not torch.equal(raw, snapped)
    model = qat.stored_weights(nn.Sequential(layer))
    assert torch.equal(layer.weight, snapped)
    upstream = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    (layer.weight * upstream).sum().backward()
    assert torch.equal(layer.parametrizations.weight.original.grad, upstream)
    qat.bake(model)
    assert type(layer.weight) is nn.Parameter
    assert torch.equal(layer.weight, snapped)
