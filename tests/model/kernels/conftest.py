"""Kernel tests run Triton in its interpreter on CPU. Triton reads TRITON_INTERPRET when a kernel is decorated, so it
is set before model.kernels is imported (model.kernels sets it too when no GPU is present)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
