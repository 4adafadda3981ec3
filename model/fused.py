"""Elementwise chains fused by torch.compile on a GPU.

Most kernels of a decode step are the glue of a few pure functions — RMSNorm, the mHC mixes, collapse and
expand —, each a chain of casts, products and one reduction per row, one kernel per torch op. On CUDA tensors
outside autograd, `fused(fn)` runs fn compiled by torch.compile (inductor writes one or two Triton kernels for the
chain); elsewhere fn itself runs, so the CPU path and training keep the plain torch ops they are tested as.

Shapes compile as they come (a dimension turns dynamic once it is seen to change; a size of 1 is always its own
case). A fused function meets a few of them — one token per row (decode), 1 + w (verify widths), γ (drafts), prefill
chunks, contiguous or not — so the recompile limit is raised from dynamo's 8, past which it would run the function
uncompiled. A CUDA-graph capture follows a warm-up call of the same shapes (model.graphs), so nothing compiles
while capturing. Compiled calls hold one process-wide lock: dynamo's FX-tracing flag is global, so a compilation in
one thread (a decode step) makes a compiled call in another (a local prefill chunk) fail. A fused function's plain
form is its `__wrapped__`, which another fused function calls to compile both into one.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable[..., object])
RECOMPILE_LIMIT = 64  # compiled variants per fused function
_COMPILED_CALLS = threading.RLock()


def fused(fn: F) -> F:
    compiled: list[Callable[..., object]] = []  # made on the first CUDA call: a CPU process never loads the compiler

    @functools.wraps(fn)
    def run(*args: object) -> object:
        tensors = [a for a in args if isinstance(a, Tensor)]
        if not tensors[0].is_cuda or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return fn(*args)
        with _COMPILED_CALLS:
            if not compiled:
                limit = torch._dynamo.config.recompile_limit
                torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
                compiled.append(torch.compile(fn, dynamic=None))
            return compiled[0](*args)

    return run  # type: ignore[return-value]
