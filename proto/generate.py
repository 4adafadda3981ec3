"""Regenerate (or, with --check, verify) the committed Python modules of every `.proto` under proto/.

Run from anywhere: `python -m proto.generate [--check]`. Sources are compiled with the repository root
as the include path, so `proto/cache/v1/cache.proto` becomes the importable `proto.cache.v1.cache_pb2`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def sources() -> list[Path]:
    return sorted((ROOT / "proto").rglob("*.proto"))


def _compile(out_dir: Path) -> dict[Path, bytes]:
    """Compile every source into out_dir; return {path relative to ROOT: content}."""
    from grpc_tools import protoc  # dev-only dependency

    protos = [str(p.relative_to(ROOT)) for p in sources()]
    if not protos:
        return {}
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return {
        p.relative_to(out_dir): p.read_bytes()
        for p in out_dir.rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def stale_files() -> list[str]:
    """Generated modules that differ from (or are missing next to) a fresh compile."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = _compile(Path(tmp))
    committed = {
        p.relative_to(ROOT): p.read_bytes()
        for p in (ROOT / "proto").rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }
    names = set(fresh) | set(committed)
    return sorted(str(n) for n in names if fresh.get(n) != committed.get(n))


def generate() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = _compile(Path(tmp))
        for rel in fresh:
            target = ROOT / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / rel, target)
    return sorted(str(p) for p in fresh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed modules are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {name}", file=sys.stderr)
        return 1 if stale else 0
    for name in generate():
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
