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
OVERLAYS = ("dev", "gpu", "released", "released-mmap", "multinode")
GPU_OVERLAYS = ("gpu", "released", "released-mmap", "multinode")  # the production shapes: `gpu` and those on it
RANK_GROUP_OVERLAYS = ("released", "released-mmap", "multinode")  # the released checkpoint: rank groups of 8 / 4
# GPUs (and rank processes) a pod of those groups: decode holds the whole model, prefill the encoder half's experts.
RANKS = {"decode": 8, "prefill": 4}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")
ROLES = ("gateway", "prefill", "decode", "cache")
COMPONENT = "app.kubernetes.io/component"
GROUP_ROLE = "v41mesh/group-role"  # leader or worker, on the pod templates of a LeaderWorkerSet

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


def group_parts(lws: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A LeaderWorkerSet as two workloads of one pod template each, its leader's and its workers' (`part` says
    which): shaped like a Deployment (`spec.template`) so that every check of a pod template applies to both. The
    LWS controller makes the selectors; these views have none."""
    group = lws["spec"]["leaderWorkerTemplate"]
    return [
        {"kind": lws["kind"], "metadata": lws["metadata"], "part": part, "spec": {"template": group[f"{part}Template"]}}
        for part in ("leader", "worker")
    ]


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod template's owner: Deployments and StatefulSets as rendered, a LeaderWorkerSet as its two parts."""
    found: list[dict[str, Any]] = []
    for o in objects:
        if o["kind"] == "LeaderWorkerSet":
            found.extend(group_parts(o))
        elif o["kind"] in WORKLOAD_KINDS:
            found.append(o)
    return found


def role_of(workload: Mapping[str, Any]) -> str:
    return workload["spec"]["template"]["metadata"]["labels"][COMPONENT]


def is_group_worker(workload: Mapping[str, Any]) -> bool:
    """A LeaderWorkerSet's worker part: pods of node rank > 0, which serve only their metrics port."""
    return workload.get("part") == "worker"


def workload(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    """The workload of the pods that serve `role`'s gRPC: for a LeaderWorkerSet, its leader part."""
    (found,) = [w for w in workloads(objects) if role_of(w) == role and not is_group_worker(w)]
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
