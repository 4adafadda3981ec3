"""The committed generated modules under proto/ match a fresh protoc run (`python -m proto.generate`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from proto import generate


def test_no_generated_module_is_stale() -> None:
    assert generate.sources(), "no .proto sources found"
    assert generate.stale_files() == [], "run `python -m proto.generate` and commit the result"


def test_the_check_sees_an_edited_proto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(generate.ROOT / "proto", tmp_path / "proto")
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    assert generate.stale_files() == []
    edited = tmp_path / "proto/cache/v1/cache.proto"
    edited.write_text(edited.read_text().replace("message StatsRequest {}", "message StatsRequest { bool x = 1; }"))
    assert "proto/cache/v1/cache_pb2.py" in generate.stale_files()


def test_generated_packages_ship_in_a_wheel() -> None:
    # Every folder holding generated modules is a package (has __init__.py), so setuptools includes it.
    for proto in generate.sources():
        for folder in (proto.parent, proto.parent.parent):
            assert (folder / "__init__.py").exists(), f"{folder} lacks __init__.py"
