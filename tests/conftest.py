"""Suite-wide set-up. Triton reads TRITON_INTERPRET when a kernel is first decorated, so without a GPU the
interpreter must be switched on before any test module imports triton (directly or through model.kernels); gRPC
reads GRPC_ENABLE_FORK_SUPPORT when first imported, numpy its BLAS threads. The demo checkpoint's mesh is shared by
the tests that need it."""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # before any test imports grpc: see mesh/__init__.py
# The interpreter's dots are numpy matmuls: on one BLAS thread a row's result does not depend on the rows beside it
# (as on the GPU's tensor cores), which the batch-invariance tests rely on; read when numpy first loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from mesh.processes import Mesh, MeshSpec

DEMO_CHECKPOINT = Path(__file__).resolve().parents[1] / "model" / "checkpoints" / "v41-demo"


@pytest.fixture(scope="session")
def demo_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The whole mesh serving the committed demo checkpoint (`make up`'s model) as processes on loopback. DSpark
    slows a CPU down at this checkpoint's acceptance (docs/benchmarks.md); greedy output is the same. The tests that
    use it load it with dozens of concurrent generations on a CPU shared with the rest of the suite: a decode message
    may take longer than a client would wait for it in production."""
    spec = MeshSpec(
        model=str(DEMO_CHECKPOINT),
        data_dir=tmp_path_factory.mktemp("demo-mesh"),
        decode_args=["--no-speculation"],
        gateway_args=["--stall-timeout-s", "600"],
    )
    running = Mesh(spec)
    running.start(300.0)
    yield running
    running.stop()
