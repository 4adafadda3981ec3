"""What `mesh k8s apply` sends (the plan) and how `mesh k8s status` reads the cluster's answers, on the objects and
the API objects themselves; applying to a real cluster is outside this suite (no cluster here)."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import K8S, rendered

from mesh.k8s import ManifestError
from mesh.k8s.apply import SecretRef, plan, required_secrets
from mesh.k8s.kustomize import build
from mesh.k8s.status import autoscaler, deployment_rollout, pod_problem, statefulset_rollout, summarise


def test_plan_creates_the_namespace_then_network_policies_then_the_rest_in_rendered_order() -> None:
    objects = rendered("gpu")
    calls = plan(objects)
    assert len(calls) == len(objects)
    assert calls[0].describe() == "namespace/v41mesh"
    assert calls[0].namespace is None
    policies = [c for c in calls if c.kind == "NetworkPolicy"]
    assert calls[1 : 1 + len(policies)] == policies
    assert calls[1 + len(policies) :] == [c for c in plan(objects) if c.kind not in ("Namespace", "NetworkPolicy")]
    first_pod_owner = next(i for i, c in enumerate(calls) if c.kind in ("Deployment", "StatefulSet"))
    assert first_pod_owner > len(policies), "no pod runs before its ingress rules exist"
    for call in calls[1:]:
        assert call.namespace == "v41mesh"
        assert call.body["metadata"]["namespace"] == "v41mesh"
        assert call.body["metadata"]["name"] == call.name
    assert {c.describe() for c in calls} >= {"deployment.apps/prefill", "statefulset.apps/cache", "service/cache"}


def test_plan_needs_a_namespace_for_objects_that_name_none() -> None:
    objects = build(K8S / "base")
    with pytest.raises(ManifestError, match="ServiceAccount/gateway has no namespace"):
        plan(objects)
    calls = plan(objects, namespace="team-a")
    assert {c.namespace for c in calls} == {"team-a"}


def test_secrets_the_pods_need_but_the_manifests_do_not_create() -> None:
    assert required_secrets(plan(rendered("gpu"))) == [
        SecretRef("v41mesh", "gateway-api-key", "deployment.apps/gateway")
    ]
    assert required_secrets(plan(rendered("dev"))) == [], "optional in dev"
    with_secret = [*rendered("gpu"), {"apiVersion": "v1", "kind": "Secret",
                                      "metadata": {"name": "gateway-api-key", "namespace": "v41mesh"}}]  # fmt: skip
    assert required_secrets(plan(with_secret)) == []


# --- status, on objects shaped as the API server returns them ---


def _deployment(generation: int = 2, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "prefill", "generation": generation},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 2, **status},
    }


@pytest.mark.parametrize(
    ("deployment", "state", "detail"),
    [
        (_deployment(3), "progressing", "waiting for the controller to observe the new spec"),
        (_deployment(updatedReplicas=1, replicas=3, availableReplicas=2), "progressing", "1 of 2 replicas updated"),
        (_deployment(updatedReplicas=2, replicas=3, availableReplicas=2), "progressing", "1 old replicas pending"),
        (_deployment(updatedReplicas=2, replicas=2, availableReplicas=1), "progressing", "1 of 2 updated replicas"),
        (_deployment(updatedReplicas=2, replicas=2, availableReplicas=2, readyReplicas=2), "ready", "rolled out"),
        (
            _deployment(conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]),
            "failed",
            "exceeded its progress deadline",
        ),
    ],
)
def test_deployment_rollout_follows_kubectl_rollout_status(deployment: dict, state: str, detail: str) -> None:
    workload = deployment_rollout(deployment)
    assert workload.state == state
    assert workload.detail.startswith(detail)


def test_statefulset_rollout_waits_for_ready_replicas_and_the_new_revision() -> None:
    sts = {
        "metadata": {"name": "cache", "generation": 1},
        "spec": {"replicas": 3},
        "status": {"observedGeneration": 1, "readyReplicas": 2, "currentRevision": "a", "updateRevision": "b"},
    }
    assert statefulset_rollout(sts).detail == "2 of 3 replicas ready"
    sts["status"] |= {"readyReplicas": 3, "updatedReplicas": 1}
    assert statefulset_rollout(sts).detail == "1 of 3 replicas at the new revision"
    sts["status"] |= {"updatedReplicas": 3, "currentRevision": "b"}
    assert statefulset_rollout(sts).state == "ready"


def _pod(name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


def test_pod_problems_say_why_a_replica_is_not_serving() -> None:
    unschedulable = _pod(
        "decode-1",
        phase="Pending",
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}],
    )  # fmt: skip
    missing_secret = _pod(
        "gateway-0",
        containerStatuses=[{"name": "gateway", "ready": False, "state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "gateway-api-key" not found'}}}],
    )  # fmt: skip
    crashing = _pod(
        "cache-0",
        containerStatuses=[{"name": "cache", "ready": False, "restartCount": 4,
                            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                            "lastState": {"terminated": {"reason": "OOMKilled"}}}],
    )  # fmt: skip
    loading = _pod("prefill-0", containerStatuses=[{"name": "prefill", "ready": False, "started": False}])
    ready = _pod("prefill-1", conditions=[{"type": "Ready", "status": "True"}],
                 containerStatuses=[{"name": "prefill", "ready": True, "started": True}])  # fmt: skip
    terminating = {"metadata": {"name": "decode-0", "deletionTimestamp": "2026-11-29T10:00:00Z"}, "status": {}}
    assert pod_problem(unschedulable) == (
        "decode-1: unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    )
    assert pod_problem(missing_secret) == (
        'gateway-0: gateway: CreateContainerConfigError: secret "gateway-api-key" not found'
    )
    assert pod_problem(crashing) == "cache-0: cache: CrashLoopBackOff (last exit: OOMKilled): back-off 40s"
    assert pod_problem(loading) == "prefill-0: prefill: waiting for its startup probe (loading), 0 restarts"
    assert pod_problem(ready) is None
    assert pod_problem(terminating) is None


def test_autoscalers_show_the_queue_depth_or_why_it_is_missing() -> None:
    spec = {
        "minReplicas": 1,
        "maxReplicas": 8,
        "metrics": [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": "v41mesh_decode_queue_depth"},
                    "target": {"type": "AverageValue", "averageValue": "8"},
                },
            }
        ],
    }
    working = {"metadata": {"name": "decode"}, "spec": spec, "status": {"currentReplicas": 2, "desiredReplicas": 3,
               "currentMetrics": [{"type": "Pods", "pods": {"metric": {"name": "v41mesh_decode_queue_depth"},
                                                            "current": {"averageValue": "12500m"}}}]}}  # fmt: skip
    broken = {"metadata": {"name": "decode"}, "spec": spec, "status": {"conditions": [
        {"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric",
         "message": "unable to fetch metrics from custom metrics API"}]}}  # fmt: skip
    scaler = autoscaler(working)
    assert (scaler.current, scaler.desired, scaler.bounds) == (2, 3, "1-8")
    assert scaler.metric == "v41mesh_decode_queue_depth 12500m / 8"
    assert autoscaler(broken).metric == "no metric: unable to fetch metrics from custom metrics API"


def test_the_mesh_is_ready_only_when_every_rollout_is_and_no_pod_holds_one_back() -> None:
    done = _deployment(updatedReplicas=2, replicas=2, availableReplicas=2, readyReplicas=2)
    assert summarise([done], [], [], []).ready
    assert not summarise([], [], [], []).ready, "nothing deployed is not ready"
    stuck = _pod("prefill-9", containerStatuses=[{"name": "prefill", "ready": False, "started": True}])
    summary = summarise([done], [], [stuck], [])
    assert not summary.ready
    assert summary.problems == ["prefill-9: prefill: waiting for its readiness probe, 0 restarts"]
