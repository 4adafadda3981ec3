"""Rollout and readiness of a deployed mesh, from the objects the API server returns (as JSON dicts).

A workload is `ready` when its rollout is complete (kubectl's rules for `rollout status`), `progressing` while pods
are being replaced or started, `failed` when its progress deadline passed. Pods that hold a rollout back get one line
each with the reason users need (unschedulable for want of a GPU, image pull errors, a missing Secret, crash loops,
probes still failing). Autoscalers show their replica counts and whether their queue-depth metric arrives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

State = Literal["ready", "progressing", "failed"]
_WAITING_PROBLEMS = frozenset(
    {
        "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
        "CreateContainerError", "RunContainerError",
    }
)  # fmt: skip


class Workload(msgspec.Struct, frozen=True):
    kind: str
    name: str
    desired: int
    ready: int
    updated: int
    state: State
    detail: str


class Autoscaler(msgspec.Struct, frozen=True):
    name: str
    current: int
    desired: int
    bounds: str  # "min-max"
    metric: str  # current value vs target, or why it is missing


class Summary(msgspec.Struct, frozen=True):
    workloads: list[Workload]
    autoscalers: list[Autoscaler]
    problems: list[str]  # one line per pod that holds a rollout back

    @property
    def ready(self) -> bool:
        return bool(self.workloads) and all(w.state == "ready" for w in self.workloads) and not self.problems


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c.get("type") == kind), {})


def deployment_rollout(dep: Mapping[str, Any]) -> Workload:
    spec, status, meta = dep.get("spec", {}), dep.get("status", {}), dep["metadata"]
    desired = spec.get("replicas", 1)
    updated, available = status.get("updatedReplicas", 0), status.get("availableReplicas", 0)
    state: State = "progressing"
    if meta.get("generation", 0) > status.get("observedGeneration", 0):
        detail = "waiting for the controller to observe the new spec"
    elif _condition(dep, "Progressing").get("reason") == "ProgressDeadlineExceeded":
        state, detail = "failed", "exceeded its progress deadline"
    elif updated < desired:
        detail = f"{updated} of {desired} replicas updated"
    elif status.get("replicas", 0) > updated:
        detail = f"{status['replicas'] - updated} old replicas pending termination"
    elif available < updated:
        detail = f"{available} of {updated} updated replicas available"
    else:
        state, detail = "ready", "rolled out"
    return Workload("Deployment", meta["name"], desired, status.get("readyReplicas", 0), updated, state, detail)


def statefulset_rollout(sts: Mapping[str, Any]) -> Workload:
    spec, status, meta = sts.get("spec", {}), sts.get("status", {}), sts["metadata"]
    desired, ready = spec.get("replicas", 1), status.get("readyReplicas", 0)
    updated = status.get("updatedReplicas", 0)
    state: State = "progressing"
    if not status.get("observedGeneration") or meta.get("generation", 0) > status["observedGeneration"]:
        detail = "waiting for the controller to observe the new spec"
    elif ready < desired:
        detail = f"{ready} of {desired} replicas ready"
    elif status.get("updateRevision") and status.get("updateRevision") != status.get("currentRevision"):
        detail = f"{updated} of {desired} replicas at the new revision"
    else:
        state, detail = "ready", "rolled out"
    return Workload("StatefulSet", meta["name"], desired, ready, updated, state, detail)


def pod_problem(pod: Mapping[str, Any]) -> str | None:
    """Why this pod is not serving, in a line, or None when it is ready."""
    name, status = pod["metadata"]["name"], pod.get("status", {})
    if pod["metadata"].get("deletionTimestamp"):
        return None  # terminating on purpose (rollout, scale-down); its replacement is what matters
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False":
        return f"{name}: unschedulable: {scheduled.get('message', scheduled.get('reason', ''))}"
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for c in containers:
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _WAITING_PROBLEMS:
            last = ((c.get("lastState") or {}).get("terminated") or {}).get("reason")
            cause = f" (last exit: {last})" if last else ""
            return f"{name}: {c['name']}: {waiting['reason']}{cause}: {waiting.get('message', '')}".rstrip(": ")
    if _condition(pod, "Ready").get("status") == "True":
        return None
    for c in status.get("containerStatuses") or []:
        if not c.get("ready"):
            probe = "startup probe (loading)" if not c.get("started") else "readiness probe"
            return f"{name}: {c['name']}: waiting for its {probe}, {c.get('restartCount', 0)} restarts"
    return f"{name}: {status.get('phase', 'Unknown')}"


def autoscaler(hpa: Mapping[str, Any]) -> Autoscaler:
    spec, status = hpa.get("spec", {}), hpa.get("status", {})
    active = _condition(hpa, "ScalingActive")
    if active.get("status") == "False":
        metric = f"no metric: {active.get('message', active.get('reason', ''))}"
    else:
        # Per-pod metrics (queue depth): what each replica reports on average, against the target.
        current = {
            m["pods"]["metric"]["name"]: m["pods"]["current"].get("averageValue", "?")
            for m in status.get("currentMetrics") or []
            if m.get("type") == "Pods"
        }
        metric = ", ".join(
            f"{m['pods']['metric']['name']} {current.get(m['pods']['metric']['name'], '?')} / "
            f"{m['pods']['target'].get('averageValue')}"
            for m in spec.get("metrics") or []
            if m.get("type") == "Pods"
        )
    return Autoscaler(
        hpa["metadata"]["name"],
        status.get("currentReplicas", 0),
        status.get("desiredReplicas", 0),
        f"{spec.get('minReplicas', 1)}-{spec.get('maxReplicas')}",
        metric,
    )


def summarise(
    deployments: list[Mapping[str, Any]],
    statefulsets: list[Mapping[str, Any]],
    pods: list[Mapping[str, Any]],
    hpas: list[Mapping[str, Any]],
) -> Summary:
    workloads = [deployment_rollout(d) for d in deployments] + [statefulset_rollout(s) for s in statefulsets]
    problems = [p for p in map(pod_problem, pods) if p is not None]
    return Summary(
        sorted(workloads, key=lambda w: (w.kind, w.name)),
        sorted(map(autoscaler, hpas), key=lambda a: a.name),
        sorted(problems),
    )
