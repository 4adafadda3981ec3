"""SwiGLU with the released clamps (swiglu_limit): the activation of every expert, routed and shared (reference §2.7).

The packed model's shared expert takes it with its FP8 cast from one kernel (`kernels.swiglu_cast`), its routed
experts in their grouped GEMM's epilogue (`kernels.moe_gate_up_cast`); this is the plain form both reproduce.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from model.fused import fused


@fused
def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """silu(min(gate, limit)) · clamp(up, ±limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
