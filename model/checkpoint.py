"""Checkpoints in the released layout, read shard by shard and written as a stream.

    DIR/config.json                            the config, nested as released (`text_config`, `quantization_config`)
    DIR/model-0000i-of-0000N.safetensors       the shards (tensor names and stored dtypes: `model.weights`)
    DIR/model.safetensors.index.json           {"metadata": {"total_size"}, "weight_map": {tensor: shard file}}

A directory of `*.safetensors` without an index is read too. Loading parses the index and each shard's header
(never a payload) to learn every tensor's shard, dtype and shape; the model part then reads only the tensors it
holds, memory-mapped, one shard at a time, straight into its packed storage — so a prefill machine never touches
the decoder's tensors, and nothing is dequantised. The checkpoint's fingerprint (part of every prefix-cache key)
comes from the config, the index and the shard headers, whose metadata carries the writer's weight identity.

    python -m model.checkpoint write --preset tiny --out DIR [--seed 0] [--shard-mib 4096] [--device auto]
    python -m model.checkpoint info DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from model.config import ModelArgs, preset
from model.engram_store import Placement
from model.parallel import SINGLE, Parallel
from model.shared_tables import SharedTables
from model.transformer import Part, Transformer
from model.weights import (
    build_model,
    engram_table_names,
    expected_names,
    filled_elsewhere,
    map_tensor,
    model_fingerprint,
    seeded_tensors,
    state_tensors,
    store,
    weight_bytes,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 4 << 30
_HEADER_LIMIT = 100 << 20  # a safetensors header longer than this is not one
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}  # fmt: skip
_EXPERT_SCALE = re.compile(r"\.ffn\.experts\.\d+\.w1\.scale$")


@dataclass(frozen=True)
class Entry:
    """One stored tensor, as its shard's header describes it (the shape as torch sees it: F4 holds two per byte)."""

    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # of its bytes in the shard file


@dataclass(frozen=True)
class LoadReport:
    read_bytes: int  # the checkpoint tensors this part read
    weight_bytes: int  # the loaded model's persistent state
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.read_bytes / max(self.seconds, 1e-9) / 1e9


def _header(path: Path) -> bytes:
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if not 0 < size <= _HEADER_LIMIT:
            raise ValueError(f"{path}: not a safetensors file (header length {size})")
        return fh.read(size)


def _entries(path: Path, header: bytes) -> dict[str, Entry]:
    try:
        table = json.loads(header)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: unreadable safetensors header ({exc})") from exc
    entries = {}
    for name, info in table.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which no model tensor uses")
        shape = tuple(info["shape"])
        if info["dtype"] == "F4":
            shape = (*shape[:-1], shape[-1] // 2)
        begin, end = info["data_offsets"]
        entries[name] = Entry(path, _DTYPES[info["dtype"]], shape, end - begin, 8 + len(header) + begin)
    return entries


class Checkpoint:
    """A checkpoint directory: its config, and where each tensor is (read from the index and the shard headers)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        self.index = index.read_bytes() if index.exists() else b""
        if self.index:
            files = sorted(set(json.loads(self.index)["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {self.directory}")
        self.headers = {name: _header(self.directory / name) for name in files}
        self.entries: dict[str, Entry] = {}
        for name, header in self.headers.items():
            self.entries |= _entries(self.directory / name, header)
        if self.index:
            for tensor, file in json.loads(self.index)["weight_map"].items():
                if self.entries.get(tensor, Entry(Path(), torch.uint8, (), 0, 0)).shard.name != file:
                    raise ValueError(f"{index} places {tensor} in {file}, whose header does not hold it")
        self.args = _with_expert_block(ModelArgs.from_json(self.directory / CONFIG_FILE), self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def fingerprint(self) -> bytes:
        """BLAKE2b-128 of the config, the index and every shard header (names, dtypes, shapes, offsets, metadata)."""
        h = hashlib.blake2b(digest_size=16, person=b"v41-checkpoint")
        h.update(json.dumps(self.args.to_dict(), sort_keys=True).encode())
        h.update(self.index)
        for name, header in sorted(self.headers.items()):
            h.update(f"{name}|{len(header)}|".encode())
            h.update(header)
        return h.digest()

    def tensors(self, names: Iterable[str], progress: bool = False) -> Iterator[tuple[str, Tensor]]:
        """The named tensors (those present), memory-mapped one shard at a time, in file order."""
        wanted = [n for n in names if n in self.entries]
        bar = tqdm(total=sum(self.entries[n].nbytes for n in wanted), unit="B", unit_scale=True, desc="load",
                   disable=not progress)  # fmt: skip
        by_shard: dict[Path, list[str]] = {}
        for name in wanted:
            by_shard.setdefault(self.entries[name].shard, []).append(name)
        start = time.perf_counter()
        with bar:
            for shard, shard_names in sorted(by_shard.items()):
                with safe_open(str(shard), framework="pt", device="cpu") as f:
                    for name in shard_names:
                        yield name, f.get_tensor(name)
                        bar.update(self.entries[name].nbytes)
                        bar.set_postfix_str(f"{bar.n / max(time.perf_counter() - start, 1e-9) / 1e9:.2f} GB/s")

    def mapped(self, name: str) -> Tensor:
        """A stored tensor memory-mapped read-only from its shard: no byte is read until a row is touched, and the
        page cache (not the process) holds what is."""
        entry = self.entries[name]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return map_bytes(entry.shard, entry.offset, entry.nbytes).view(entry.dtype).view(entry.shape)


def map_bytes(path: Path, offset: int, nbytes: int) -> Tensor:
    """`nbytes` bytes of a file from `offset`, memory-mapped read-only as a uint8 tensor. Random access is declared
    (MADV_RANDOM): a row lookup faults in its own page, not a read-ahead window around it."""
    with open(path, "rb") as fh:
        whole = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    whole.madvise(mmap.MADV_RANDOM)
    raw = np.frombuffer(whole, dtype=np.uint8, count=nbytes, offset=offset)
    with warnings.catch_warnings():  # read-only by design: nothing writes a mapped table
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(raw)


def _with_expert_block(args: ModelArgs, entries: dict[str, Entry]) -> ModelArgs:
    """The config with the FP4 experts' scale block the stored scales have: [I, C/32] or [I, C/16] — the same for
    every expert; anything else is refused, naming the tensor."""
    q = args.quantization_config
    blocks = {}
    for name in (n for n in entries if _EXPERT_SCALE.search(n)):
        columns = entries[name].shape[-1]
        blocks[name] = args.hidden_size // columns if columns and args.hidden_size % columns == 0 else 0
        if blocks[name] not in (16, 32) or blocks[name] != next(iter(blocks.values())):
            raise ValueError(
                f"{name}: scale shape {list(entries[name].shape)} is neither [I, C/32] nor [I, C/16] for hidden_size "
                f"C = {args.hidden_size}, or differs from the other experts'"
            )
    if q is None or not blocks:
        return args
    return args.replace(
        quantization_config=type(q)(**{**q.__dict__, "expert_scale_block": next(iter(blocks.values()))})
    )


# ------------------------------------------------------------------------------------------------------ load
def load_weights(
    model: Transformer,
    directory: str | os.PathLike[str],
    progress: bool = False,
    mapped: Iterable[str] = (),
    elsewhere: Iterable[str] = (),
) -> LoadReport:
    """Fill a built model part from the checkpoint in `directory`, reading only the tensors it holds; the `mapped`
    ones (the Engram tables of `--engram-store mmap`) are memory-mapped from their shards instead of read, and the
    `elsewhere` ones are neither (another rank fills them: `model.shared_tables`)."""
    checkpoint = Checkpoint(directory)
    start = time.perf_counter()
    mapped, skip = set(mapped), set(mapped) | set(elsewhere)
    for name in mapped:
        map_tensor(model, name, checkpoint.mapped(name) if name in checkpoint.entries else None, str(directory))
    read = store(model, checkpoint.tensors(expected_names(model) - skip, progress), str(directory), skip=skip)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    model.fingerprint = checkpoint.fingerprint()
    return LoadReport(read, weight_bytes(model), time.perf_counter() - start)


def load_checkpoint(
    directory: str | os.PathLike[str],
    part: Part = "full",
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    packed: bool = True,
    engram: Placement = "device",
    parallel: Parallel = SINGLE,
    shared: SharedTables | None = None,
) -> Transformer:
    """A model part from a checkpoint directory: packed (serving) or float (training), its Engram tables placed by
    `engram` (`model.engram_store`; with `shared`, in the node's table file, read by its owner alone); an
    expert-parallel rank (`parallel`) reads its own routed experts only. Its `load_report` says what was read, how
    fast, and the resident weight bytes."""
    args = Checkpoint(directory).args
    model = build_model(
        args, part, seed=None, device=device, dtype=dtype, packed=packed, engram=engram, parallel=parallel,
        shared=shared,
    )  # fmt: skip
    mapped = engram_table_names(model) if engram == "mmap" else []
    model.load_report = load_weights(model, directory, progress, mapped, filled_elsewhere(model, engram, shared))
    return model


def checkpoint_fingerprint(directory: str | os.PathLike[str]) -> bytes:
    return Checkpoint(directory).fingerprint()


# ----------------------------------------------------------------------------------------------------- write
def released_config(args: ModelArgs) -> dict:
    """config.json as released: the text backbone under `text_config`, the storage under `quantization_config`."""
    text = args.to_dict()
    quantization = text.pop("quantization_config")
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": args.model_type, "text_config": text,
            "quantization_config": quantization}  # fmt: skip


def write_checkpoint(
    directory: str | os.PathLike[str],
    args: ModelArgs,
    tensors: Iterable[tuple[str, Tensor]],
    *,
    identity: str,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = False,
    extra: Mapping[str, str] | None = None,
) -> Path:
    """Write tensors as they come into shards of at most `shard_bytes` (one shard in host memory at a time), then
    the index, the config and any `extra` text files. `identity` names the weights (their digest, or how they were
    generated): it is in every shard header, hence in the fingerprint. A previous checkpoint at `directory` is
    replaced only once all is written."""
    out = Path(directory)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[list[str]] = []
    pending: dict[str, Tensor] = {}
    pending_bytes = total = 0

    def flush() -> None:
        save_file(pending, str(tmp / f"shard-{len(shards):05d}"), metadata={"format": "pt", "weights": identity})
        shards.append(list(pending))
        pending.clear()

    for name, t in tqdm(tensors, desc="write", unit="tensor", disable=not progress):
        t = t.detach().contiguous().cpu()
        size = t.numel() * t.element_size()
        if pending and pending_bytes + size > shard_bytes:
            flush()
            pending_bytes = 0
        pending[name] = t
        pending_bytes += size
        total += size
    if pending or not shards:
        flush()
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(tmp / f"shard-{i:05d}", tmp / file)
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (tmp / CONFIG_FILE).write_text(json.dumps(released_config(args), indent=2, sort_keys=True) + "\n")
    for file, text in (extra or {}).items():
        (tmp / file).write_text(text)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def save_checkpoint(model: Transformer, directory: str | os.PathLike[str], shard_bytes: int = SHARD_BYTES) -> Path:
    """A model (either form) in the released layout; its identity is the digest of the tensors written."""
    tensors = dict(state_tensors(model))
    identity = model_fingerprint(model.args, tensors).hex()
    return write_checkpoint(directory, model.args, tensors.items(), identity=identity, shard_bytes=shard_bytes)


def write_seeded(
    directory: str | os.PathLike[str],
    args: ModelArgs,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = False,
) -> Path:
    """The synthetic checkpoint of a preset: the weights `build_model(args, seed=seed, device=device, dtype=dtype)`
    holds, generated one tensor at a time on `device`."""
    device = torch.device(device)
    identity = f"seeded:{seed}:{str(dtype).removeprefix('torch.')}:{device.type}"
    tensors = seeded_tensors(args, "full", seed, device, dtype)
    return write_checkpoint(directory, args, tensors, identity=identity, shard_bytes=shard_bytes, progress=progress)


# -------------------------------------------------------------------------------------------------------- CLI
def _info(directory: str) -> str:
    c = Checkpoint(directory)
    a, q = c.args, c.args.quantization_config
    lines = [
        f"checkpoint {c.directory}",
        f"  model        {a.model_type}: hidden {a.hidden_size}, {a.num_hidden_layers} layers, "
        f"{a.n_routed_experts} experts",
        f"  storage      {'plain' if q is None else f'FP8 32×32 blocks, FP4 experts (scale / {q.expert_scale_block})'}",
        f"  shards       {len(c.headers)} ({'indexed' if c.index else 'no index'})",
        f"  tensors      {len(c.entries):,} = {c.nbytes / 2**30:,.3f} GiB",
        f"  fingerprint  {c.fingerprint().hex()}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write a seeded synthetic checkpoint in the released layout")
    write.add_argument("--preset", required=True, help="preset name (tiny, demo, small, v41-flash) or config.json")
    write.add_argument("--out", required=True, help="directory to write (replaced once the new one is complete)")
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--shard-mib", type=float, default=SHARD_BYTES / 2**20, help="shard size limit (MiB)")
    write.add_argument("--device", default="auto", help="where the weights are generated (auto: cuda if present)")
    write.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="plain tensors' dtype")
    info = commands.add_parser("info", help="what a checkpoint holds, and its fingerprint (reads headers only)")
    info.add_argument("directory")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "info":
            print(_info(ns.directory))
            return 0
        device = ns.device if ns.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        start = time.perf_counter()
        out = write_seeded(ns.out, preset(ns.preset), seed=ns.seed, device=device, dtype=getattr(torch, ns.dtype),
                           shard_bytes=int(ns.shard_mib * 2**20), progress=sys.stderr.isatty())  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    print(_info(str(out)))
    print(f"  written in   {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
