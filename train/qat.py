"""Quantisation-aware training switches (reference §2.10).

The model always applies the released activation QAT (FP8 linear inputs, FP8 SWA ring, FP4 indexer q/K) and the
FP4 main-KV fake-quant in its dense path. Training adds two switches:

- `stored_weights(model)`: every FP8 / FP4 weight is seen through its checkpoint format (straight-through
  gradient), so the exported checkpoint holds exactly the weights training evaluated. `torch.nn.utils.parametrize`
  does the bookkeeping; `bake(model)` removes the parametrisations and leaves the snapped values.
- `main_kv("bf16")`: the compressed main KV is rounded to bf16 instead of FP4 (E2M1 + E4M3 scale per 16). This is
  the no-QAT baseline of the paper's claim (and the bf16-KV side of its evaluation). It is the model's own switch
  (`model.attention.main_kv`), in force for the block in this thread.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor, nn
from torch.nn.utils import parametrize

from model.attention import MainKV as KVFormat
from model.attention import main_kv
from model.engram import Engram
from model.linear import Linear
from model.weights import dequantize_weight, quantize_weight

__all__ = ["KVFormat", "StoredWeight", "bake", "main_kv", "stored_weights"]


class StoredWeight(nn.Module):
    """A weight as its checkpoint format decodes it; the gradient passes straight through the rounding."""

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = fmt

    def forward(self, w: Tensor) -> Tensor:
        snapped = dequantize_weight(*quantize_weight(w.detach(), self.fmt), self.fmt, w.dtype)
        return snapped + (w - w.detach())  # value: exactly `snapped`; gradient: identity


def _stored_formats(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized:
            yield module, module.fmt
        elif isinstance(module, Engram) and model.args.quantization_config is not None:
            yield module.embed, "fp8_rows"


def stored_weights(model: nn.Module) -> nn.Module:
    """Register the weight-format parametrisation on every quantised weight of `model` (idempotent)."""
    for module, fmt in _stored_formats(model):
        if not parametrize.is_parametrized(module, "weight"):
            parametrize.register_parametrization(module, "weight", StoredWeight(fmt))
    return model


def bake(model: nn.Module) -> nn.Module:
    """Remove the parametrisations, keeping the snapped values as the plain weights."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    return model
