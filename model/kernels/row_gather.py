"""Row gather from a table the GPU reads where it lies: out[i] = table[ids[i]].

With unified addressing, page-locked host memory (`pin_memory`, `cudaHostRegister`) is mapped into the GPU's address
space: a kernel can load it over PCIe, a row at a time, with no host work and no copy of the table. The Engram tables
held in host memory (model.engram_store) are gathered this way inside a captured decode step, from ids the step hashed
on the device: a step's few hundred to few thousand rows (a few hundred bytes each) cross the bus while block 0 runs.

The rows are moved as opaque words (the widest integer type dividing a row's bytes), so any dtype — E4M3 bytes,
UE8M0 scales, bf16 rows — is copied bit for bit.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from model.kernels.launch import dependent_launch, follow

TILE_WORDS = 2048  # words a program moves per column chunk: a few rows of 256 B, many of a narrow table


def gather_rows_torch(table: Tensor, ids: Tensor, out: Tensor) -> None:
    out.copy_(table[ids.to(table.device)])


def gather_rows_triton(table: Tensor, ids: Tensor, out: Tensor) -> None:
    M = ids.shape[0]
    if M == 0:
        return
    src, dst = _words(table), _words(out)
    W = src.shape[1]
    block_w = min(triton.next_power_of_2(W), 256)
    block_m = max(1, TILE_WORDS // block_w)
    grid = (triton.cdiv(M, block_m),)
    _gather_rows_kernel[grid](src, ids, dst, M, W, block_m, block_w, **dependent_launch(out.device, grid))


def _words(t: Tensor) -> Tensor:
    """A contiguous [N, ...] tensor as [N, words] of the widest integer type that divides a row's bytes."""
    row = t.view(torch.uint8).view(t.shape[0], math.prod(t.shape[1:]) * t.element_size())
    for word in (torch.int64, torch.int32, torch.int16):
        if row.shape[1] % word.itemsize == 0:
            return row.view(word)
    return row


@triton.jit
def _gather_rows_kernel(
    table, ids, out, M, W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
):  # fmt: skip
    follow(PDL, EARLY)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = m < M
    row = tl.load(ids + m, mask=live, other=0).to(tl.int64)
    for w0 in tl.static_range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        mask = live[:, None] & (w[None, :] < W)
        words = tl.load(table + row[:, None] * W + w[None, :], mask=mask)
        tl.store(out + m.to(tl.int64)[:, None] * W + w[None, :], words, mask=mask)
