"""Rendered overlays and the helpers the k8s tests read them with (imported by name: pytest puts this directory
on sys.path)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mesh.k8s.kustomize import build

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = ("dev", "gpu", "released", "released-mmap")
GPU_OVERLAYS = ("gpu", "released", "released-mmap")  # the production shapes: `gpu` and the released checkpoint on it
RANK_GROUP_OVERLAYS = ("released", "released-mmap")  # the released checkpoint: rank groups of 8 / 4
# GPUs (and rank processes) a pod of those groups: decode holds the whole model, prefill the encoder half's experts.
RANKS = {"decode": 8, "prefill": 4}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
ROLES = ("gateway", "prefill", "decode", "cache")
COMPONENT = "app.kubernetes.io/component"

_RENDERED: dict[str, list[dict[str, Any]]] = {}


def rendered(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects (rendered once per test process; tests must not modify them)."""
    if overlay not in _RENDERED:
        _RENDERED[overlay] = build(K8S / "overlays" / overlay)
    return _RENDERED[overlay]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def role_of(workload: Mapping[str, Any]) -> str:
    return workload["spec"]["template"]["metadata"]["labels"][COMPONENT]


def workload(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (found,) = [w for w in workloads(objects) if role_of(w) == role]
    return found


def pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for w in workloads(objects):
        spec = pod_spec(w)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            yield w, c


def env_value(container: Mapping[str, Any], name: str) -> dict[str, Any]:
    (entry,) = [e for e in container.get("env", []) if e["name"] == name]
    return entry


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics: matchLabels and matchExpressions, all ANDed; {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, present = labels.get(expr["key"]), expr["key"] in labels
        ok = {
            "In": present and value in expr.get("values", []),
            "NotIn": not present or value not in expr.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[expr["operator"]]
        if not ok:
            return False
    return True


def selected_workloads(objects: list[dict[str, Any]], selector: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [w for w in workloads(objects) if selects(selector, w["spec"]["template"]["metadata"]["labels"])]


def container_ports(workload: Mapping[str, Any]) -> dict[str, int]:
    """name → containerPort over the workload's containers (unnamed ports under their number)."""
    return {
        p.get("name", str(p["containerPort"])): p["containerPort"]
        for c in pod_spec(workload)["containers"]
        for p in c.get("ports", [])
    }


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "m": 10**-3}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("64Gi", "500m", "2") as a number."""
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert match, f"not a quantity: {value!r}"
    return float(match.group(1)) * _UNITS.get(match.group(2), 1) if match.group(2) else float(match.group(1))


def flag(args: list[str], name: str) -> str | None:
    """The value following `name` in a container's args."""
    return args[args.index(name) + 1] if name in args else None
