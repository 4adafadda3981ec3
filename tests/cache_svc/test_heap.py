"""cache_svc.heap: the malloc thresholds are really set on this (glibc) platform."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from cache_svc import heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_thresholds_take_effect_and_stay() -> None:
    assert heap.keep_freed_memory()
    assert heap.keep_freed_memory()  # once per process, then cached
    # glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: ours must be within what it accepts.
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert libc.mallopt(heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_BYTES) == 1
