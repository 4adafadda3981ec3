"""Where the Engram tables live, and how a step's rows reach its Engram layers (DESIGN §10, reference §4.3).

Each released table holds ≈ 384 M FP8 rows (≈ 98 GB): the GPU is no place for it. Row ids depend only on the token
stream, so they are known before the first layer runs. Placements (`--engram-store`):

- `device`: the tables are parameters on the model's device; a step hashes its ids and looks its rows up there
  (the CPU runs, and small models).
- `host`: the tables stay FP8 (E4M3 rows + UE8M0 scales, as released) in pinned host memory.
- `mmap`: the tables are memory-mapped from the checkpoint's own shards (no second copy on disk); the page cache
  holds what the token stream touches.

Where the tables are in pinned host memory, a GPU step does without the host: as the forward's first work it hashes
its own tokens on the device and, on a side stream, gathers their rows from the tables in place, the GPU reading the
mapped host memory over PCIe while block 0 (the layers before the first Engram layer) runs; the Engram layer's
stream waits on the gather's event (`InPlaceMemory` for an eager forward — a prefill chunk —, `StagedMemory` for
one captured as a CUDA graph). Tables the GPU cannot read (`mmap`'s pages of the shards) go through the host: a step's
token ids and look-back are on the host as soon as the step is built (`EngramFetch.start`); once block 0 is
launched, the host hashes them, gathers the rows into a pinned staging buffer (a big step's in pieces, by a small
pool of threads) and issues one non-blocking host-to-device copy per table on a side stream, which the Engram layer
waits for in the same way. A layer decodes the same bytes by the same function whichever placement fetched them, so
the outputs are bit-identical.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from model import kernels
from model.config import ModelArgs
from model.engram import NgramHash
from model.linear import Embedding, Fp8Rows

if TYPE_CHECKING:
    from model.cache import Step
    from model.transformer import Transformer

Placement = Literal["device", "host", "mmap"]
PLACEMENTS: tuple[str, ...] = ("auto", "device", "host", "mmap")
HOST_SHARE = 0.8  # `auto` keeps the tables in host memory when they take at most this share of what is available
GATHER_ROWS = 4096  # rows per gather task: enough to amortise a task, few enough to spread a big prefill chunk
UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as the largest page-aligned int64


def available_host_bytes(cgroups: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> int:
    """The host memory available to new allocations: the host's (MemAvailable, or the physical memory where unknown),
    or less where this process's memory cgroup (a container's limit: `cgroup_free_bytes`) leaves less."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError), open("/proc/meminfo") as fh:
        host = next((int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:")), host)
    limited = cgroup_free_bytes(cgroups, membership)
    return host if limited is None else min(host, limited)


def cgroup_free_bytes(cgroups: Path, membership: Path) -> int | None:
    """What this process's memory cgroup and its ancestors still let it allocate (the least of limit − usage over
    those with a limit; cgroup v2's memory.max / memory.current, or v1's memory controller), None where none has."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    free: list[int] = []
    for hierarchy, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        if hierarchy == "0":
            root, files = cgroups, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root, files = cgroups / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        node = root / path.strip("/")
        while root in (node, *node.parents):
            with contextlib.suppress(OSError, ValueError):
                limit, usage = ((node / f).read_text().strip() for f in files)
                if limit != "max" and int(limit) < UNLIMITED:
                    free.append(max(0, int(limit) - int(usage)))
            if node == root:
                break
            node = node.parent
    return min(free) if free else None


def choose_placement(requested: str, table_bytes: int, device: torch.device, checkpoint: bool) -> Placement:
    """The placement for `--engram-store requested`: `auto` keeps the tables on a CPU model's own device; on a GPU,
    in host memory when they fit `HOST_SHARE` of what is available, else mapped from the checkpoint. ValueError for
    an unknown name, or `mmap` without a checkpoint to map."""
    if requested not in PLACEMENTS:
        raise ValueError(f"--engram-store must be one of {', '.join(PLACEMENTS)}, got {requested!r}")
    if requested == "mmap" and not checkpoint:
        raise ValueError("--engram-store mmap maps the checkpoint's shards: it needs a checkpoint directory as --model")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    if device.type != "cuda":
        return "device"
    if table_bytes <= HOST_SHARE * available_host_bytes() or not checkpoint:
        return "host"
    return "mmap"


def table_bytes(args: ModelArgs, dtype: torch.dtype) -> int:
    """Bytes of a model's Engram tables: FP8 rows and their scales when quantised, else rows in `dtype`."""
    rows, dim = sum(args.engram_num_embeddings), args.engram_head_dim
    if args.quantization_config is not None:
        return rows * (dim + dim // 32)
    return rows * dim * torch.empty(0, dtype=dtype).element_size()


def engram_tables(model: Transformer) -> dict[int, Embedding | Fp8Rows]:
    """Each Engram layer's table (its `embed`: float rows, or FP8 rows and scales), by layer."""
    return {block.layer: block.engram.embed for block in model.layers if hasattr(block, "engram")}


class Memory(Protocol):
    """A step's Engram rows: `values(layer)` → the decoded rows [B, T, R, head_dim] of that layer's table."""

    def values(self, layer: int) -> Tensor: ...


class DeviceMemory:
    """Rows hashed and looked up on the model's device (the `device` placement, and the dense training forward)."""

    def __init__(self, model: Transformer, tokens: Tensor, history: Tensor) -> None:
        self.model, self.rows = model, model.engram_rows(tokens, history)

    def values(self, layer: int) -> Tensor:
        return self.model.layers[layer].engram.embed(self.rows[layer])


class Fetched(NamedTuple):
    """One layer's gathered rows on the model's device — the table's stored tensors (E4M3 bytes and UE8M0 scales, or
    float rows) at the step's ids —, the event of their copy (None on a CPU model) and the ids' shape [B, T, R]."""

    rows: tuple[Tensor, ...]
    copied: torch.cuda.Event | None
    shape: torch.Size


class HostMemory:
    """A step's rows in host tables, fetched when its first Engram layer is reached — the launching thread has queued
    the layers before it, which the device runs meanwhile: every layer's ids are hashed and their gathers queued
    then, in layer order, and each layer finishes its own fetch (waits for its rows, starts their copy) when it is
    reached, so a later table's gather runs behind the layers before it. `values` makes the current stream wait for
    the layer's copy, not the host."""

    def __init__(
        self,
        start: Callable[[], dict[int, Callable[[], Fetched]]],
        decode: Callable[[int, tuple[Tensor, ...]], Tensor],
    ) -> None:
        self.start, self.decode = start, decode
        self.pending: dict[int, Callable[[], Fetched]] | None = None
        self.fetched: dict[int, Fetched] = {}

    def values(self, layer: int) -> Tensor:
        if self.pending is None:
            self.pending = self.start()
        if layer not in self.fetched:
            self.fetched[layer] = self.pending.pop(layer)()
        rows, copied, shape = self.fetched[layer]
        _arrived(rows, copied)
        return self.decode(layer, rows).view(*shape, -1)


class InPlaceMemory:
    """The rows of an eager forward on a GPU whose tables are in pinned host memory: the forward's first work hashes
    its tokens on the device and gathers every layer's rows from the tables in place on the side stream
    (`EngramFetch.gather_in_place`), beside the layers before the first Engram layer; `values` makes the current
    stream wait for the gather, not the host."""

    def __init__(self, fetch: EngramFetch, tokens: Tensor, history: Tensor) -> None:
        self.fetch = fetch
        side = fetch.stream
        if side is not None:  # None: a CPU model told to gather in place (the torch reference, inline)
            side.wait_stream(torch.cuda.current_stream(fetch.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            ids = {layer: fetch.device_hash.rows(layer, tokens, history) for layer in fetch.tables}
            self.shape = {layer: ids[layer].shape for layer in fetch.tables}
            self.rows = {layer: _rows_like(fetch.tables[layer], ids[layer].numel(), fetch.device) for layer in ids}
            fetch.gather_in_place({layer: ids[layer].view(-1) for layer in ids}, self.rows)
            self.gathered = torch.cuda.Event() if side is not None else None
            if self.gathered is not None:
                self.gathered.record(side)

    def values(self, layer: int) -> Tensor:
        _arrived(self.rows[layer], self.gathered)
        return self.fetch.decode(layer, self.rows[layer]).view(*self.shape[layer], -1)


class EngramFetch:
    """Fetches steps' Engram rows from tables held off the device (`host`, `mmap`) of one model: gathered by the
    device in place where it can read the tables (`in_place`: `InPlaceMemory`, and `StagedMemory` inside a graph),
    otherwise by the host (`start`: `HostMemory`).

    The host's work runs on the thread that launches the step, when its first Engram layer is reached: hashing every
    layer's ids is a few numpy ops, and a decode step's rows (B × T × R per table) are gathered in one call; a step
    of more than `gather_rows` ids (a prefill chunk) is gathered in pieces by `gather_threads` threads, each holding
    the GIL only to start its piece, every layer's pieces queued at once in layer order, so the later tables are
    gathered while the launching thread goes on. (Worker threads that also hashed and copied would wait for the GIL
    behind the launching thread for milliseconds per hand-over.) The copies are the asynchronous part: a piece's
    runs on a side stream as soon as it is gathered, while the device runs the layers before."""

    def __init__(
        self,
        model: Transformer,
        gather_threads: int = 4,
        gather_rows: int = GATHER_ROWS,
        gather_on_device: bool | None = None,
    ) -> None:
        self.device, self.gather_rows, self.gather_on_device = model.device, gather_rows, gather_on_device
        self.hash = NgramHash(model.args)  # on the host, beside the tables
        self.device_hash = model.ngram  # the model's own, on its device: a forward that hashes its own tokens
        self.tables = engram_tables(model)
        self.gatherers = ThreadPoolExecutor(gather_threads, thread_name_prefix="engram-gather")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.staging: dict[int, tuple[Tensor, ...]] = {}  # layer → pinned rows of its stored tensors, grown
        self.last_copy: dict[int, torch.cuda.Event] = {}  # layer → the copy that last read its staging
        self.gathering: dict[int, list[tuple[slice, list[Future]]]] = {}  # layer → the pieces last queued into it

    def memory(self, step: Step) -> InPlaceMemory | HostMemory:
        """The rows of an eager forward's step: gathered in place from its tokens and look-back on the device, as its
        first work, where the GPU reads the tables (`in_place`); else fetched by the host (`start`)."""
        if self.in_place():
            return InPlaceMemory(self, step.tokens, step.history)
        return self.start(*step.host_ids())

    def start(self, tokens: Tensor, history: Tensor) -> HostMemory:
        """The rows of a step — tokens [B, T] and history [B, n−1], int64 on the host — to fetch from every layer's
        table (and copy to the device) when the first Engram layer is reached."""
        return HostMemory(lambda: self._fetch_all(tokens, history), self.decode)

    def close(self) -> None:
        self.gatherers.shutdown(wait=True)

    def in_place(self) -> bool:
        """Whether a captured forward gathers its rows on the device from the tables where they lie: tables in
        page-locked host memory, which the GPU reads mapped (`gather_on_device` decides where given: a CPU model
        then runs the same forwards, gathering with the torch reference)."""
        if self.gather_on_device is not None:
            return self.gather_on_device
        stored = [t for table in self.tables.values() for t in _stored(table)]
        return self.device.type == "cuda" and all(t.is_pinned() for t in stored)

    def gather_in_place(self, ids: dict[int, Tensor], out: dict[int, tuple[Tensor, ...]]) -> None:
        """out[layer][i] ← each of the layer's stored tensors at the rows ids[layer] (flat, on the model's device),
        read from the tables where they lie (`kernels.gather_rows`), on the current stream."""
        for layer, rows in out.items():
            for dst, src in zip(rows, _stored(self.tables[layer]), strict=True):
                kernels.gather_rows(src, ids[layer], dst, backend=kernels.backend_for(dst))

    def decode(self, layer: int, rows: tuple[Tensor, ...]) -> Tensor:
        table = self.tables[layer]
        return Fp8Rows.decode(*rows, table.dtype) if isinstance(table, Fp8Rows) else rows[0]

    def _fetch_all(self, tokens: Tensor, history: Tensor) -> dict[int, Callable[[], Fetched]]:
        ids = self.hash.host_rows(tokens.numpy(), history.numpy())
        return {layer: self._fetch(layer, ids[layer]) for layer in self.tables}

    def _fetch(self, layer: int, ids: np.ndarray) -> Callable[[], Fetched]:
        """Start gathering a layer's rows; the returned call finishes the fetch: it copies each piece of rows to the
        model's device as soon as it is gathered (on a GPU on the side stream, so the copy runs beside the gather;
        a CPU model takes the same copies, which keep the staging free for the next step)."""
        staged = self._staged(layer, ids.size)
        pieces = self.gathering[layer] = self._gather_pieces(layer, ids.reshape(-1), staged)

        def finish() -> Fetched:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                moved = tuple(torch.empty_like(t, device=self.device) for t in staged)
                for rows, gathered in pieces:
                    for task in gathered:
                        task.result()
                    for dst, src in zip(moved, staged, strict=True):
                        dst[rows].copy_(src[rows], non_blocking=True)
                copied = None
                if self.stream is not None:
                    copied = self.last_copy[layer] = torch.cuda.Event()
                    copied.record(self.stream)
            self.gathering.pop(layer, None)
            return Fetched(moved, copied, torch.Size(ids.shape))

        return finish

    def gather(self, layer: int, ids: np.ndarray, out: tuple[Tensor, ...], out_bytes: Bytes | None = None) -> None:
        """out[i] = table[ids[i]] for each of the layer's stored tensors (`_gather_pieces`), waited for. `out_bytes`:
        out's `_row_bytes`, where the caller keeps them."""
        _wait(self._gather_pieces(layer, ids, out, out_bytes))

    def _gather_pieces(
        self, layer: int, ids: np.ndarray, out: tuple[Tensor, ...], out_bytes: Bytes | None = None
    ) -> list[tuple[slice, list[Future]]]:
        """Gather table[ids] into out: inline (numpy's take over the rows' bytes: a decode step's few hundred rows in
        microseconds, where torch's intra-op threads cost more than the copy; one piece, no task left), or queued on
        the gather threads in pieces of `gather_rows` rows — (rows, their tasks) in order."""
        step = self.gather_rows
        if ids.size <= step:
            table = _row_bytes(_stored(self.tables[layer]))  # made per call: loading may swap a table's tensors
            for src, dst in zip(table, out_bytes or _row_bytes(out), strict=True):
                np.take(src, ids, axis=0, out=dst)
            return [(slice(0, ids.size), [])]
        index = torch.from_numpy(ids)
        return [
            (
                slice(i, i + step),
                [
                    self.gatherers.submit(torch.index_select, src, 0, index[i : i + step], out=dst[i : i + step])
                    for src, dst in zip(_stored(self.tables[layer]), out, strict=True)
                ],
            )
            for i in range(0, ids.size, step)
        ]

    def _staged(self, layer: int, n: int) -> tuple[Tensor, ...]:
        """Rows for n ids of a layer's stored tensors: staging reused from step to step (pinned for a GPU), free to
        overwrite once the previous copy from it has ended."""
        _wait(self.gathering.pop(layer, []))  # a step given up before its layer was reached: its pieces still write
        if layer in self.last_copy:
            self.last_copy[layer].synchronize()
        have = self.staging.get(layer)
        if have is None or have[0].shape[0] < n:
            size = max(n, 2 * have[0].shape[0]) if have is not None else n
            have = _rows_like(self.tables[layer], size, pin=self.stream is not None)
            self.staging[layer] = have
        return tuple(t[:n] for t in have)


class StagedMemory:
    """The Engram rows of a forward captured as a CUDA graph (model.graphs) over [B, T] tokens: fixed device buffers
    the graph fills on a side stream as its first work (`start`, captured with the forward), beside the layers before
    the first Engram layer, which waits for them on the device (`values`). The rows come in one of two ways:

    - in place (`EngramFetch.in_place`: tables in page-locked host memory): the graph hashes its tokens on the
      device and gathers the rows from the tables where they lie (`kernels.gather_rows`, the GPU reading mapped host
      memory over PCIe): nothing runs on the host before a replay;
    - staged (tables the GPU cannot read: `mmap`'s pages of the shards): before the replay the host hashes the
      step's ids and gathers their rows into fixed pinned buffers (`stage`), which the graph copies.

    On a CPU model the gathered rows are the layer's input."""

    def __init__(self, fetch: EngramFetch, batch: int, length: int) -> None:
        self.fetch, self.cuda, self.in_place = fetch, fetch.stream is not None, fetch.in_place()
        h = fetch.hash.args.engram_max_ngram_size - 1
        probe = np.zeros((batch, length), dtype=np.int64), np.full((batch, h), -1, dtype=np.int64)
        self.shape = {layer: torch.Size(ids.shape) for layer, ids in fetch.hash.host_rows(*probe).items()}  # [B, T, R]
        rows = {layer: self.shape[layer].numel() for layer in fetch.tables}
        if self.in_place:
            self.host: dict[int, tuple[Tensor, ...]] = {}
            self.rows = {layer: _rows_like(table, rows[layer], fetch.device) for layer, table in fetch.tables.items()}
        else:
            self.host = {layer: _rows_like(table, rows[layer], pin=self.cuda) for layer, table in fetch.tables.items()}
            self.rows = {
                layer: tuple(torch.empty_like(t, device=fetch.device) for t in pinned) if self.cuda else pinned
                for layer, pinned in self.host.items()
            }
        self.host_bytes = {layer: _row_bytes(pinned) for layer, pinned in self.host.items()}
        self.copied = torch.cuda.Event() if self.cuda else None
        self.read: torch.cuda.Event | None = None  # the end of the last forward that copied the pinned buffers

    def stage(self, tokens: Tensor, history: Tensor) -> None:
        """Gather the rows of tokens [B, T] after the look-back history [B, n−1] (int64, host) into the pinned
        buffers, once the last forward has copied the previous ones out (staged rows only)."""
        if self.read is not None:
            self.read.synchronize()
        ids = self.fetch.hash.host_rows(tokens.numpy(), history.numpy())
        for layer in self.fetch.tables:
            self.fetch.gather(layer, ids[layer].reshape(-1), self.host[layer], self.host_bytes[layer])

    def staged(self) -> None:
        """The forward that copies the staged rows has been launched: the next `stage` waits for its end."""
        if self.cuda:
            self.read = torch.cuda.Event()
            self.read.record()

    def start(self, tokens: Tensor, history: Tensor) -> StagedMemory:
        """Fill every layer's rows on the side stream, forked from the current one (inside the captured forward,
        before its first layer): gathered in place for the step's tokens [B, T] after history [B, n−1] (on the
        model's device), else copied from the staging."""
        side = self.fetch.stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if self.in_place:
                ids = {layer: self.fetch.device_hash.rows(layer, tokens, history).view(-1) for layer in self.rows}
                self.fetch.gather_in_place(ids, self.rows)
            elif self.cuda:
                for layer, pinned in self.host.items():
                    for dst, src in zip(self.rows[layer], pinned, strict=True):
                        dst.copy_(src, non_blocking=True)
            if self.copied is not None:
                self.copied.record(side)
        return self

    def values(self, layer: int) -> Tensor:
        if self.copied is not None:
            torch.cuda.current_stream().wait_event(self.copied)
        return self.fetch.decode(layer, self.rows[layer]).view(*self.shape[layer], -1)


Bytes = tuple[np.ndarray, ...]


def _arrived(rows: tuple[Tensor, ...], event: torch.cuda.Event | None) -> None:
    """Make the current stream wait for rows a side stream filled (event None: filled in order already)."""
    if event is None:
        return
    stream = torch.cuda.current_stream(rows[0].device)
    stream.wait_event(event)
    for t in rows:
        t.record_stream(stream)  # side-stream memory: not reused before this stream is done with it


def _wait(pieces: list[tuple[slice, list[Future]]]) -> None:
    for _, tasks in pieces:
        for task in tasks:
            task.result()


def _row_bytes(tensors: tuple[Tensor, ...]) -> Bytes:
    """Stored tensors' rows [N, ...] (a table's, or staging buffers') as numpy arrays of their bytes [N, row bytes],
    no copy."""
    return tuple(t.view(torch.uint8).view(t.shape[0], -1).numpy() for t in tensors)


def _rows_like(
    table: Embedding | Fp8Rows, n: int, device: torch.device | None = None, pin: bool = False
) -> tuple[Tensor, ...]:
    """Buffers for n rows of each of a table's stored tensors (`pin`: page-locked host memory)."""
    return tuple(torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=device, pin_memory=pin) for t in _stored(table))


def _stored(table: Embedding | Fp8Rows) -> tuple[Tensor, ...]:
    """The stored tensors of a table: (E4M3 rows as bytes, UE8M0 scales) or (float rows,)."""
    if isinstance(table, Fp8Rows):
        return table.weight.view(torch.uint8), table.scale
    return (table.weight,)


# How each off-device placement gathers: host memory answers at memory speed (big pieces, a few threads); a mapped
# table may fault every row in from the disk, so its gathers are small pieces on many threads (NVMe needs requests
# in flight, and a thread blocks on each fault).
GATHERING = {
    "host": {"gather_threads": 4, "gather_rows": GATHER_ROWS},
    "mmap": {"gather_threads": 32, "gather_rows": 64},
}


def place_tables(model: Transformer, placement: Placement) -> None:
    """Give a model whose tables are off its device (`host`, `mmap`) the fetcher its steps use."""
    model.engram_fetch = EngramFetch(model, **GATHERING[placement]) if placement != "device" else None
