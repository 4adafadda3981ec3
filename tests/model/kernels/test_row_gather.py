"""The row gather (model/kernels/row_gather.py) in Triton's interpreter against indexing: the same bytes for rows of
every width a table stores (E4M3 rows and their UE8M0 scales, bf16 rows, odd byte counts), repeated ids and rows far
into the table; shapes and dtypes that do not match are refused by name."""

import pytest
import torch
from kernel_cases import generator

from model import kernels


def table(rows: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    raw = torch.randint(0, 256, (rows, *shape), dtype=torch.uint8, generator=generator(seed))
    return raw.view(dtype) if dtype.itemsize == 1 else raw.view(-1).view(dtype).view(rows, -1)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((256,), torch.float8_e4m3fn),  # a released Engram row: 32 eight-byte words
        ((8,), torch.uint8),  # its scales: one word
        ((64,), torch.bfloat16),
        ((3,), torch.uint8),  # bytes moved one by one
        ((2, 6), torch.uint8),  # a row of two dims, 12 bytes: int32 words
        ((1200,), torch.uint8),  # wider than one chunk of columns
    ],
)
def test_gathered_rows_are_the_indexed_rows_bit_for_bit(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = table(997, shape, dtype, seed=len(shape) * shape[-1])
    ids = torch.randint(0, t.shape[0], (301,), generator=generator(3))
    ids[:5] = torch.tensor([0, 996, 996, 0, 500])  # the ends, and repeats
    want = torch.empty((ids.shape[0], *t.shape[1:]), dtype=dtype)
    got = torch.empty_like(want)
    kernels.gather_rows(t, ids, want, backend="torch")
    kernels.gather_rows(t, ids, got, backend="triton")
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(want.view(torch.uint8), t[ids].view(torch.uint8))


def test_no_ids_gather_nothing() -> None:
    t = table(4, (16,), torch.uint8, seed=1)
    out = torch.empty(0, 16, dtype=torch.uint8)
    kernels.gather_rows(t, torch.zeros(0, dtype=torch.int64), out, backend="triton")


def test_mismatched_arguments_are_refused_by_name() -> None:
    t = table(10, (8,), torch.uint8, seed=2)
    ids = torch.arange(4)
    with pytest.raises(ValueError, match=r"out: expected shape \[4, 8\]"):
        kernels.gather_rows(t, ids, torch.empty(4, 7, dtype=torch.uint8), backend="triton")
    with pytest.raises(ValueError, match=r"out: expected dtype torch\.uint8"):
        kernels.gather_rows(t, ids, torch.empty(4, 8, dtype=torch.int8), backend="triton")
    with pytest.raises(ValueError, match="ids: expected dtype"):
        kernels.gather_rows(t, ids.float(), torch.empty(4, 8, dtype=torch.uint8), backend="triton")
