"""KV formats: FP4 main KV (E4M3 scale / 16), FP4 indexer K (UE8M0 / 32), FP8 SWA ring (UE8M0 / 32).

The torch side is model/quant.py itself; the Triton side reproduces its bytes exactly.
"""

import torch
from torch import Tensor

from model import quant

KV_BLOCK = 16
INDEX_BLOCK = 32
SWA_BLOCK = 32


def quantize_kv_fp4_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    return quant.fp4_quant_e4m3(x, KV_BLOCK)


def quantize_index_fp4_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    return quant.fp4_quant_ue8m0(x, INDEX_BLOCK)


def quantize_swa_fp8_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    return quant.fp8_quant(x, SWA_BLOCK)


def dequantize_kv_fp4_torch(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return quant.fp4_dequant_e4m3(data, scale, KV_BLOCK, dtype)


def dequantize_index_fp4_torch(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return quant.fp4_dequant_ue8m0(data, scale, INDEX_BLOCK, dtype)


def dequantize_swa_fp8_torch(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return quant.fp8_dequant(data, scale, SWA_BLOCK, dtype)
