"""One copy of the host Engram tables for every rank of a node.

With `--engram-store host`, each rank process of a group would otherwise hold its own copy of the tables (≈ 189 GiB
for the released config: an 8-rank decode pod would need 1.5 TiB of host memory). Instead the node's first rank
creates an anonymous memory file (`memfd_create`) before it spawns the others, which inherit its descriptor; it sizes
the file once it has built its model, and fills the tables there while the others build theirs. Every rank maps the
same pages (MAP_SHARED) and, on a GPU, page-locks its mapping, as `host` does with a private copy.

The file has no name in any file system: its pages are freed with the last process that maps it, so a crashed group
leaves nothing behind, and it takes no room from `/dev/shm`. The ranks meet on the group's store: the owner announces
the file's size (the others map it then) and, after its load, that the tables are filled (the others wait for that
before their first forward).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

FD_ENV = "V41MESH_ENGRAM_TABLES_FD"  # the inherited descriptor's number, in a spawned rank's environment
ALIGN = 4096  # each table tensor starts on a page


class SharedTables:
    """The node's table file (`fd`) as this rank sees it: `owner` sizes and fills it, every rank maps it. `store`
    and `node`: where the ranks of node `node` meet; `timeout`: the longest wait for the owner (its whole load)."""

    def __init__(self, fd: int, owner: bool, store: dist.Store, node: int, timeout: datetime.timedelta) -> None:
        self.fd, self.owner, self.store, self.timeout = fd, owner, store, timeout
        self._sized, self._filled = f"engram-tables/{node}/bytes", f"engram-tables/{node}/filled"

    @staticmethod
    def create() -> int:
        """A new, empty table file: its descriptor, for the ranks this process spawns (`subprocess`'s pass_fds)."""
        return os.memfd_create("v41mesh-engram-tables")

    @staticmethod
    def inherited() -> int | None:
        """The descriptor a spawned rank inherited (None: this process shares no tables)."""
        fd = os.environ.get(FD_ENV)
        return int(fd) if fd else None

    def tensors(self, specs: Sequence[tuple[torch.Size, torch.dtype]], pin: bool) -> list[Tensor]:
        """Tensors of the given shapes and dtypes laid out one after another in the file (the same layout on every
        rank: each builds the same tables); `pin`: page-lock this rank's mapping for copies to its GPU."""
        offsets, end = [], 0
        for shape, dtype in specs:
            offsets.append(end)
            end += -(-shape.numel() * dtype.itemsize // ALIGN) * ALIGN
        if self.owner:
            os.ftruncate(self.fd, end)
            self.store.set(self._sized, str(end))
        else:
            self.store.wait([self._sized], self.timeout)
            announced = int(self.store.get(self._sized))
            if announced != end:
                raise RuntimeError(f"the node's Engram table file holds {announced} bytes, this rank's tables {end}")
        region = torch.empty(0, dtype=torch.uint8, device="cpu")
        if end:
            region.set_(torch.UntypedStorage.from_file(f"/proc/self/fd/{self.fd}", shared=True, nbytes=end))
        if pin and end:
            _page_lock(region)
        return [
            region[o : o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, specs, strict=True)
        ]

    def filled(self) -> None:
        """The owner: its tables are filled. Another rank: wait until they are."""
        if self.owner:
            self.store.set(self._filled, "1")
        else:
            self.store.wait([self._filled], self.timeout)


def _page_lock(region: Tensor) -> None:
    """Register a mapped host region with CUDA (cudaHostRegister): page-locked, as `pin_memory` allocates."""
    code = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel(), 0)
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister of the shared Engram tables ({region.numel()} bytes) failed: {code}")
