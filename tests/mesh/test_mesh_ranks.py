"""`python -m mesh up --decode-ranks W --prefill-ranks W`: every prefill and decode replica is started as a rank group
of W (its --ranks), each group meeting on a port of its own; W = 1 starts them as single processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.config import load_config
from mesh.processes import Mesh
from mesh.up import ENV_PREFIX, UpConfig, spec_of


def argv_of(tmp_path: Path, *flags: str) -> dict[str, list[str]]:
    cfg = load_config(UpConfig, ["--data-dir", str(tmp_path), *flags], env_prefix=ENV_PREFIX, prog="mesh up")
    return {child.name: child.argv for child in Mesh(spec_of(cfg)).children}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_rank_flags_reach_every_replica(tmp_path: Path) -> None:
    flags = ["--decode-ranks", "2", "--prefill-ranks", "4", "--decode-replicas", "2"]
    argv = argv_of(tmp_path, *flags)
    ranks = {name: flag(args, "--ranks") for name, args in argv.items() if name.startswith(("prefill", "decode"))}
    assert ranks == {"prefill-0": "4", "decode-0": "2", "decode-1": "2"}
    ports = {flag(argv[name], "--master-port") for name in ranks}
    assert len(ports) == 3  # a rendezvous of its own for each group
    assert not any("--ranks" in args for name, args in argv.items() if name not in ranks)


def test_one_rank_starts_single_processes(tmp_path: Path) -> None:
    argv = argv_of(tmp_path)
    assert not any("--ranks" in args or "--master-port" in args for args in argv.values())


def test_ranks_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        argv_of(tmp_path, "--decode-ranks", "0")
    assert exit_.value.code == 2
