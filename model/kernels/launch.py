"""Programmatic dependent launch (sm_90 and later): each kernel is placed while its predecessor drains.

Even replayed from a CUDA graph, a kernel starts only once its predecessor's last program has ended and its writes
are flushed — a gap of one to two microseconds between dependent kernels, which at a few hundred kernels a decode step
is a third of a small batch's step. Launched as a programmatic dependent, a kernel's programs are placed while the
predecessor still runs and wait for it on the device instead (`follow`):

- PDL: the kernel was launched as a dependent; it waits (`griddepcontrol.wait`) until its predecessor has ended
  and that kernel's writes are visible;
- EARLY: past that wait, it lets its own successor launch at once, not when its last program ends — only where all
  its programs fit on the GPU at once (`dependent_launch`): otherwise the successor's programs, placed once the
  kernel's last program has started, crowd onto the few SMs free at that moment.

Every kernel calls `follow` before it reads or writes anything, so launching it as a dependent never changes what it
computes. A kernel signals only after its wait, so every kernel before its predecessor has ended when it starts. A
launch that does not follow a kernel (the first of a stream, one after a copy or an event) waits for nothing.

`plain_launches()` turns it off for the launches inside it (a benchmark's peer side).
"""

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from model.kernels.formats import interpreting, multiprocessors

_plain = False


@triton.jit
def follow(PDL: tl.constexpr, EARLY: tl.constexpr):
    """A dependent launch's wait (PDL), then its successor's early launch (EARLY): the first thing a kernel does."""
    if PDL:
        gdc_wait()
    if EARLY:
        gdc_launch_dependents()


@functools.cache
def _capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def dependent(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents: on sm_90 and later, not in the interpreter
    (which cannot run the wait's PTX), not inside `plain_launches`."""
    return not _plain and not interpreting() and _capable(device)


def dependent_launch(device: torch.device, grid: tuple[int, ...], resident: int = 1) -> dict[str, bool]:
    """A kernel's launch options (its PDL and EARLY constants and Triton's `launch_pdl`) for a launch of `grid`
    programs of which `resident` per SM surely fit at once (one always does)."""
    pdl = dependent(device)
    early = pdl and math.prod(grid) <= resident * multiprocessors()
    return {"PDL": pdl, "EARLY": early, "launch_pdl": pdl}


@contextlib.contextmanager
def plain_launches() -> Iterator[None]:
    """Kernels launched inside start only after their predecessor has ended (a CUDA graph captured inside keeps it)."""
    global _plain
    before, _plain = _plain, True
    try:
        yield
    finally:
        _plain = before
