"""Batch invariance: a row's result independent of the rows computed beside it.

Speculative decoding is lossless only if the verify pass — B sequences × (1 + w) positions in one forward — gives each
position the logits a plain step of B sequences × 1 position would, bit for bit: greedy output then equals plain
greedy output token for token. On a GPU the same row's sums come out differently rounded wherever a launch picks its
reduction order from the number of rows:
- the FP8 linear picks its dot (FP8 code dots per 32-input chunk for a few tokens, scale-folded bf16 dots from
  `FOLDED_FROM` tokens) and its K splits (to fill the SMs) from the token count;
- sparse attention splits each query's key range over more programs when there are few queries;
- cuBLAS chooses split-K kernels (and reduced-precision reductions) by shape; inductor picks a reduction's block
  and its splits from the number of rows.

`set_batch_invariant(True)` fixes each of these per weight shape, not per batch: the FP8 linear always folds its scales
into bf16 dots and splits K as for a single tile of tokens; sparse attention runs one program per query and head group;
cuBLAS gets no split-K workspace and exact reductions; inductor compiles in its deterministic and batch-invariant modes
(on a torch without the latter, < 2.12, its one rule is applied here: a persistent reduction picks its row block and
warps as for 4,096 rows, so each row is summed in one order at every row count).

Triton compiles a kernel once per specialisation of its integer arguments — a value of 1, a multiple of 16 or neither —,
and two binaries of one kernel need not compute a row alike: the masks' known divisibility steers the layouts Triton
gives its tensors, so a row's elements may be spread over the threads differently and summed in another order (the mHC's
Sinkhorn, for one, is laid out one way for 24 rows and another for 144), and ptxas may contract a product into a sum in
one binary and not in the other. So every kernel of ours that sums along a row is compiled without specialising on its
row or query count (`do_not_specialize`, always: the count only bounds masks), and under batch invariance no Triton
kernel, ours or inductor's, is compiled with fp fusion (a kernel that wants a fused multiply-add says so: `tl.fma`). It
is process-wide and must be set before the first GEMM and the first compilation (cuBLAS reads its workspace size once,
and compiled kernels keep the choices they were compiled with).
"""

import functools
import os

import torch

PERSISTENT_ROWS = 4096  # inductor's batch-invariant mode chooses persistent-reduction configs as for this many rows

_invariant = False


def batch_invariant() -> bool:
    """Whether launches choose their reduction order independently of the number of rows."""
    return _invariant


def set_batch_invariant(on: bool) -> None:
    """Turn batch invariance on for this process (module docstring), before its first forward; off restores the
    kernels' own launch choices only (torch's settings stay as they were set)."""
    global _invariant
    _invariant = on
    if not on or not torch.cuda.is_available():
        return
    import torch._inductor.config as inductor  # here: a process without invariance never loads the compiler
    import triton

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"  # no room for split-K partial sums
    os.environ["CUBLASLT_WORKSPACE_SIZE"] = "1"
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the library that can be told not to split K
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = (False, False)  # (reduced-precision reductions, split-K)
    matmul.allow_fp16_reduced_precision_reduction = (False, False)
    matmul.allow_tf32 = False
    inductor.split_reductions = False
    inductor.deterministic = True  # no benchmarked choices between configs that sum in different orders
    inductor.emulate_precision_casts = True  # inductor compiles its kernels without fp fusion under this flag alone
    triton.knobs.language.default_fp_fusion = False  # ours
    if "batch_invariant" in inductor._config:
        inductor.batch_invariant = True
    else:
        _choose_persistent_blocks_as_for_many_rows()
        inductor.compile_threads = 1  # the configs are chosen where the kernels compile: in this process


def _choose_persistent_blocks_as_for_many_rows() -> None:
    """Inductor's batch-invariant rule for a torch without it: persistent-reduction configs are chosen from a row
    count of at least `PERSISTENT_ROWS`, not the compiled shape's (whose candidates and pick differ by size)."""
    from torch._inductor.runtime import triton_heuristics as heuristics

    choose = heuristics._persistent_reduction_configs
    if getattr(choose, "as_for_many_rows", False):
        return

    @functools.wraps(choose)
    def as_for_many_rows(size_hints: dict[str, int], *args: object, **kwargs: object) -> list:
        if "x" in size_hints:
            size_hints = {**size_hints, "x": max(size_hints["x"], PERSISTENT_ROWS)}
        return choose(size_hints, *args, **kwargs)

    as_for_many_rows.as_for_many_rows = True  # type: ignore[attr-defined]
    heuristics._persistent_reduction_configs = as_for_many_rows
