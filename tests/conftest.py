"""Suite-wide set-up. Triton reads TRITON_INTERPRET when a kernel is first decorated, so without a GPU the
interpreter must be switched on before any test module imports triton (directly or through model.kernels); gRPC
reads GRPC_ENABLE_FORK_SUPPORT when first imported."""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before any test imports grpc: see mesh/__init__.py
