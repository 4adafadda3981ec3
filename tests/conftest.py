"""Suite-wide set-up. Triton reads TRITON_INTERPRET when a kernel is first decorated, so without a GPU the
interpreter must be switched on before any test module imports triton (directly or through model.kernels)."""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
