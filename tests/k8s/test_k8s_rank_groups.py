"""Prefill and decode as rank groups (DESIGN §10): pods of 8 and 4 GPUs for the released checkpoint, and decode
groups across nodes as a LeaderWorkerSet (`multinode`), validated against the LWS v1 schema. Rendering only: the
services' side of the contract (--ranks, --nodes, --node-rank, --master-addr/port) is tested with the services."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
from k8s_helpers import (
    GROUP_ROLE,
    K8S,
    RANK_GROUP_OVERLAYS,
    RANKS,
    env_value,
    flag,
    group_parts,
    is_group_worker,
    named,
    of_kind,
    pod_spec,
    quantity,
    rendered,
    role_of,
    selects,
    workload,
    workloads,
)

from mesh.k8s import ManifestError, main
from mesh.k8s.kustomize import build
from mesh.k8s.validation import LWS_API_VERSION, validate

GPU = "nvidia.com/gpu"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Host memory of one rank process besides the Engram tables: CUDA context, torch, pinned staging buffers, the
# scheduler on rank 0. An estimate until a group has run on an 8-GPU node (k8s/README.md, Sizes).
PER_RANK_HOST_GIB = 10
SXM_PRODUCTS = {"NVIDIA-H100-80GB-HBM3", "NVIDIA-H200"}
GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"


def _rank_group_pods(overlay: str) -> list[dict[str, Any]]:
    return [w for w in workloads(rendered(overlay)) if role_of(w) in RANKS]


def _lws(overlay: str = "multinode") -> dict[str, Any]:
    (lws,) = of_kind(rendered(overlay), "LeaderWorkerSet")
    return lws


def _labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _opens_every_port_between(policy: dict[str, Any], parts: list[dict[str, Any]]) -> bool:
    """Whether a NetworkPolicy lets these pods reach each other on every port: it selects them all, with an ingress
    rule without ports whose peers are pod selectors (this namespace) that each select them all."""
    labels = [_labels(part) for part in parts]

    def selects_all(selector: dict[str, Any]) -> bool:
        return all(selects(selector, each) for each in labels)

    def every_port_from_them(rule: dict[str, Any]) -> bool:
        peers = rule.get("from", [])
        return (
            "ports" not in rule
            and bool(peers)
            and all(set(p) == {"podSelector"} for p in peers)
            and all(selects_all(p["podSelector"]) for p in peers)
        )

    return selects_all(policy["spec"]["podSelector"]) and any(
        every_port_from_them(rule) for rule in policy["spec"].get("ingress", [])
    )


def _parts(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    leader, worker = group_parts(lws)
    return pod_spec(leader)["containers"][0], pod_spec(worker)["containers"][0]


# --- pods of 8 and 4 GPUs ---


@pytest.mark.parametrize("overlay", RANK_GROUP_OVERLAYS)
def test_rank_group_pods_run_a_rank_a_gpu_with_nccl_shm_and_multicast_off(overlay: str) -> None:
    for w in _rank_group_pods(overlay):
        role, spec = role_of(w), pod_spec(w)
        container = spec["containers"][0]
        assert container["resources"]["limits"][GPU] == RANKS[role]
        assert flag(container["args"], "--ranks") == str(RANKS[role])
        for name, value in MULTICAST_OFF.items():
            assert env_value(container, name) == {"name": name, "value": value}, (role, name)
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        assert quantity(volume["emptyDir"]["sizeLimit"]) == RANKS[role] * 8 * 2**30, "8 GiB a rank for NCCL"


def test_one_gpu_pods_of_the_gpu_overlay_are_no_rank_groups() -> None:
    for w in workloads(rendered("gpu")):
        if role_of(w) in RANKS:
            container = pod_spec(w)["containers"][0]
            assert container["resources"]["limits"][GPU] == 1
            assert flag(container["args"], "--ranks") is None
            assert not {e["name"] for e in container["env"]} & set(MULTICAST_OFF)


@pytest.mark.parametrize("overlay", RANK_GROUP_OVERLAYS)
def test_rank_groups_need_8_gpu_nvswitch_nodes_and_get_guaranteed_whole_cores(overlay: str) -> None:
    """The all-to-all needs every GPU joined to every other (HGX boards, SXM parts: no PCIe NVL cards), and the
    kubelet aligns CPUs with GPUs only for Guaranteed pods with whole cores."""
    for w in _rank_group_pods(overlay):
        spec = pod_spec(w)
        (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        expressions = {e["key"]: e for e in term["matchExpressions"]}
        assert set(expressions[f"{GPU}.product"]["values"]) == SXM_PRODUCTS
        assert expressions[f"{GPU}.count"] == {"key": f"{GPU}.count", "operator": "Gt", "values": ["7"]}
        resources = spec["containers"][0]["resources"]
        assert resources["requests"] == resources["limits"], "Guaranteed QoS"
        cpus = quantity(resources["limits"]["cpu"])
        assert cpus == int(cpus) >= 4 * RANKS[role_of(w)]


@pytest.mark.parametrize("overlay", RANK_GROUP_OVERLAYS)
def test_prefill_pods_pair_up_on_a_node_and_replicas_spread_over_zones(overlay: str) -> None:
    """A node that one prefill pod left half free could never take a decode pod: prefill prefers nodes that already
    run prefill. Spreading over hostnames would undo that (and says nothing for decode, which fills its node)."""
    objects = rendered(overlay)
    prefill = pod_spec(workload(objects, "prefill"))
    (preferred,) = prefill["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert [role_of(w) for w in workloads(objects) if selects(term["labelSelector"], _labels(w))] == ["prefill"]
    assert RANKS["prefill"] * 2 == RANKS["decode"], "two prefill pods fill what one decode pod takes"
    for w in _rank_group_pods(overlay):
        keys = [c["topologyKey"] for c in pod_spec(w).get("topologySpreadConstraints", [])]
        assert "kubernetes.io/hostname" not in keys, role_of(w)
        if not is_group_worker(w):
            assert keys == ["topology.kubernetes.io/zone"], role_of(w)


@pytest.mark.parametrize("overlay", RANK_GROUP_OVERLAYS)
def test_host_memory_holds_the_engram_tables_once_a_pod_its_rank_processes_and_dev_shm(overlay: str) -> None:
    """`host`: one copy of the tables a pod (FP8 rows and scales, as model.engram_store sizes them), shared by its
    ranks, plus the rank processes and /dev/shm (memory-backed, so within the limit). `mmap`: no tables in the pod,
    but room for the rows the page cache holds, which the pod's limit bounds."""
    import torch

    from model.config import PRESETS
    from model.engram_store import table_bytes

    tables = table_bytes(PRESETS["v41-flash"], torch.bfloat16)
    assert 180 * 2**30 < tables < 200 * 2**30
    objects = rendered(overlay)
    (model_config,) = [c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"].startswith("model-config")]
    store = model_config["data"]["engram_store"]
    for w in _rank_group_pods(overlay):
        spec = pod_spec(w)
        limit = quantity(spec["containers"][0]["resources"]["limits"]["memory"])
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        needed = RANKS[role_of(w)] * PER_RANK_HOST_GIB * 2**30 + quantity(shm["emptyDir"]["sizeLimit"])
        if store == "host":
            assert limit >= tables + needed + 32 * 2**30, f"{role_of(w)}: 32 GiB to spare"
        else:
            assert store == "mmap"
            assert limit >= needed + 32 * 2**30, f"{role_of(w)}: 32 GiB of cached rows at least"


# --- multinode: decode groups as a LeaderWorkerSet ---


def test_multinode_runs_decode_as_a_leaderworkerset_of_8_gpu_pods_and_prefill_as_in_released() -> None:
    objects, lws = rendered("multinode"), _lws()
    assert lws["apiVersion"] == LWS_API_VERSION
    assert not [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == "decode"]
    assert named(objects, "Deployment", "prefill") == named(rendered("released"), "Deployment", "prefill")
    spec = lws["spec"]
    assert "replicas" not in spec, "the autoscaler owns the number of groups"
    group = spec["leaderWorkerTemplate"]
    assert group["size"] >= 2, "a group spans nodes"
    # A failed rank takes its group down; the group restarts whole, at a fresh rendezvous.
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The leader is ready only once every rank has joined: workers must not wait for it.
    assert spec["startupPolicy"] == "LeaderCreated"
    rollout = spec["rolloutStrategy"]
    assert rollout["type"] == "RollingUpdate"
    assert rollout["rollingUpdateConfiguration"] == {"maxUnavailable": 1, "maxSurge": 0}, "no spare group of nodes"
    for part in group_parts(lws):
        assert role_of(part) == "decode"
        assert pod_spec(part)["containers"][0]["resources"]["limits"][GPU] == RANKS["decode"]


def test_the_group_is_one_world_of_8_ranks_a_node_that_splits_the_experts_evenly() -> None:
    """World size = ranks x nodes; rank r holds experts [r·E/W, (r+1)·E/W) of the backbone's and DSpark's."""
    from model.config import PRESETS

    args = PRESETS["v41-flash"]
    lws = _lws()
    leader, worker = _parts(lws)
    for container in (leader, worker):
        assert flag(container["args"], "--ranks") == str(RANKS["decode"])
        assert flag(container["args"], "--nodes") == "$(LWS_GROUP_SIZE)", "the group's size, from LWS"
        assert flag(container["args"], "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(container["args"], "--master-port") == "29500"
    world = RANKS["decode"] * lws["spec"]["leaderWorkerTemplate"]["size"]
    assert args.n_routed_experts % world == 0
    assert args.dspark_n_routed_experts % world == 0


def test_the_leader_is_node_rank_0_serving_grpc_and_workers_take_the_lws_worker_index() -> None:
    leader, worker = _parts(_lws())
    assert flag(leader["args"], "--node-rank") == "0"
    assert flag(leader["args"], "--port") == "7003"
    assert leader["readinessProbe"]["grpc"]["service"] == "decode.v1.Decode"
    # LWS_WORKER_INDEX: the webhook's copy of the pod's leaderworkerset.sigs.k8s.io/worker-index label (1..size-1).
    assert flag(worker["args"], "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert flag(worker["args"], "--port") is None
    assert [p["name"] for p in worker["ports"]] == ["metrics"]
    assert flag(worker["args"], "--metrics-port") == str(worker["ports"][0]["containerPort"])


def test_the_group_pods_are_the_released_decode_pod_with_only_the_group_roles_added() -> None:
    """One definition of a decode pod: the LeaderWorkerSet's templates are the `released` Deployment's, changed only
    where leader and worker differ from a one-node group."""
    released = named(rendered("released"), "Deployment", "decode")["spec"]["template"]
    leader, worker = (copy.deepcopy(p["spec"]["template"]) for p in group_parts(_lws()))
    for template, role in ((leader, "leader"), (worker, "worker")):
        assert template["metadata"].pop("labels").pop(GROUP_ROLE) == role
        assert template["metadata"] == {k: v for k, v in released["metadata"].items() if k != "labels"}
    # The leader: the group's flags after the released pod's own, its spread counted over leaders.
    args = leader["spec"]["containers"][0]["args"]
    assert args[-8:-6] == ["--nodes", "$(LWS_GROUP_SIZE)"]
    del args[-8:]
    leader["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"].pop(GROUP_ROLE)
    assert leader["spec"] == released["spec"]
    # Workers: their own command line, ports and probes (metrics only); no spread, but affinity to their leader.
    spec = worker["spec"]
    assert spec["affinity"].pop("podAffinity")
    own = {
        "args",
        "ports",
        "startupProbe",
        "readinessProbe",
        "livenessProbe",
        "containers",
        "topologySpreadConstraints",
    }
    (container,), (original,) = spec["containers"], released["spec"]["containers"]
    assert {k: v for k, v in container.items() if k not in own} == {k: v for k, v in original.items() if k not in own}
    assert {k: v for k, v in spec.items() if k not in own} == {
        k: v for k, v in released["spec"].items() if k not in own
    }


def test_the_gateway_reaches_decode_leaders_only_and_the_lws_service_name_is_free() -> None:
    """The gateway's headless `decode` selects leaders. The LWS controller names its own headless Service (the
    group's pod DNS, published before readiness for the rendezvous) after the set, and makes it only where no
    Service has that name: none may."""
    objects, lws = rendered("multinode"), _lws()
    selector = {"matchLabels": named(objects, "Service", "decode")["spec"]["selector"]}
    leader, worker = group_parts(lws)
    assert selects(selector, _labels(leader))
    assert not selects(selector, _labels(worker))
    assert lws["metadata"]["name"] not in {s["metadata"]["name"] for s in of_kind(objects, "Service")}


def test_the_decode_autoscaler_scales_groups_on_the_leaders_queue() -> None:
    objects = rendered("multinode")
    hpa = named(objects, "HorizontalPodAutoscaler", "decode")
    target = {"apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet", "name": _lws()["metadata"]["name"]}
    assert hpa["spec"]["scaleTargetRef"] == target
    assert hpa["spec"]["metrics"] == named(rendered("released"), "HorizontalPodAutoscaler", "decode")["spec"]["metrics"]


def test_the_pods_of_a_group_reach_each_other_on_every_port_and_outlive_its_drain() -> None:
    """torch.distributed's store and NCCL's connections (ephemeral ports) between the group's pods; workers keep
    stepping while the leader drains its streams after SIGTERM, so they get its grace period."""
    objects = rendered("multinode")
    leader, worker = group_parts(_lws())
    policies = of_kind(objects, "NetworkPolicy")
    open_to_peers = [p["metadata"]["name"] for p in policies if _opens_every_port_between(p, [leader, worker])]
    assert open_to_peers == ["decode-group-peers"]
    assert pod_spec(worker)["terminationGracePeriodSeconds"] == pod_spec(leader)["terminationGracePeriodSeconds"]


def test_workers_prefer_their_own_leaders_zone() -> None:
    _, worker = group_parts(_lws())
    spec = pod_spec(worker)
    (preferred,) = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "topology.kubernetes.io/zone"
    assert term["matchLabelKeys"] == [GROUP_KEY], "the worker's own group, from its LWS label"
    assert term["labelSelector"]["matchLabels"][GROUP_ROLE] == "leader"
    assert "topologySpreadConstraints" not in spec


def test_an_overlay_on_multinode_reaches_the_group_pods_with_its_images_and_config(tmp_path: Path) -> None:
    """Kustomize learns the LeaderWorkerSet's image and ConfigMap paths from multinode (kustomizeconfig.yaml), and
    overlays on top inherit them: the content-hashed ConfigMap names and an `images:` entry reach the groups."""
    base = os.path.relpath(K8S / "overlays" / "multinode", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{base}]\n"
        "images: [{name: ghcr.io/v41mesh/v41mesh, newName: registry.example/v41mesh, newTag: '9'}]\n"
        "configMapGenerator: [{name: model-config, behavior: merge, literals: [model=/models/other]}]\n"
    )
    objects = build(tmp_path)
    (config,) = [c["metadata"]["name"] for c in of_kind(objects, "ConfigMap") if c["data"].get("model")]
    for part in group_parts(next(o for o in objects if o["kind"] == "LeaderWorkerSet")):
        container = pod_spec(part)["containers"][0]
        assert container["image"] == "registry.example/v41mesh:9"
        assert env_value(container, "DECODE_SVC_MODEL")["valueFrom"]["configMapKeyRef"]["name"] == config


# --- the LeaderWorkerSet schema ---


def _broken(change: str) -> dict[str, Any]:
    lws = copy.deepcopy(_lws())
    spec, group = lws["spec"], lws["spec"]["leaderWorkerTemplate"]
    if change == "size 0":
        group["size"] = 0
    elif change == "misspelt field":
        group["sise"] = group.pop("size")
    elif change == "unknown restart policy":
        group["restartPolicy"] = "Always"
    elif change == "no worker template":
        del group["workerTemplate"]
    elif change == "container typo":
        group["workerTemplate"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    elif change == "bad probe port type":
        group["leaderTemplate"]["spec"]["containers"][0]["livenessProbe"]["tcpSocket"]["port"] = {"name": "grpc"}
    elif change == "name not a DNS-1035 label":
        lws["metadata"]["name"] = "9decode"
    elif change == "surge as a word":
        spec["rolloutStrategy"]["rollingUpdateConfiguration"]["maxSurge"] = "one"
    elif change == "startup policy typo":
        spec["startupPolicy"] = "LeaderCreate"
    return lws


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("size 0", r"spec\.leaderWorkerTemplate\.size: 0 is less than the minimum of 1"),
        ("misspelt field", r"spec\.leaderWorkerTemplate: Additional properties are not allowed \('sise' was"),
        ("unknown restart policy", r"spec\.leaderWorkerTemplate\.restartPolicy: 'Always' is not one of"),
        ("no worker template", r"spec\.leaderWorkerTemplate: 'workerTemplate' is a required property"),
        ("container typo", r"spec\.leaderWorkerTemplate\.workerTemplate\.spec\.containers\.0: Additional prop.*Polcy"),
        ("bad probe port type", r"spec\.leaderWorkerTemplate\.leaderTemplate\.spec\.containers\.0\.livenessProbe\."),
        ("name not a DNS-1035 label", r"metadata\.name: '9decode' does not match"),
        ("surge as a word", r"spec\.rolloutStrategy\.rollingUpdateConfiguration\.maxSurge: 'one' is not valid"),
        ("startup policy typo", r"spec\.startupPolicy: 'LeaderCreate' is not one of"),
    ],
)
def test_a_broken_leaderworkerset_is_refused_where_it_is_broken(change: str, message: str) -> None:
    validate(_lws())
    with pytest.raises(ManifestError, match=rf"^LeaderWorkerSet/\S+: {message}"):
        validate(_broken(change))


def test_a_minimal_leaderworkerset_is_valid_and_other_versions_or_kinds_are_unknown() -> None:
    minimal = {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "web"},
        "spec": {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": [{"name": "a", "image": "b"}]}}}},
    }
    validate(minimal)
    unknown = [
        ("leaderworkerset.x-k8s.io/v1alpha1", "LeaderWorkerSet"),
        (LWS_API_VERSION, "LeaderWorkerSets"),
        ("apps/v1", "LeaderWorkerSet"),
    ]
    for api_version, kind in unknown:
        with pytest.raises(ManifestError, match=f"no Kubernetes 1.33 schema for {api_version} {kind}"):
            validate({**minimal, "apiVersion": api_version, "kind": kind})


def test_render_refuses_an_overlay_with_a_broken_leaderworkerset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    (tmp_path / "kustomization.yaml").write_text("resources: [lws.yaml]\n")
    (tmp_path / "lws.yaml").write_text(yaml.safe_dump(_broken("container typo")))
    assert main(["render", str(tmp_path)]) == 1
    assert "LeaderWorkerSet/decode-group: spec.leaderWorkerTemplate.workerTemplate.spec.containers.0: " in (
        capsys.readouterr().err
    )
    (tmp_path / "lws.yaml").write_text(yaml.safe_dump(_lws()))
    assert main(["render", str(tmp_path), "-o", str(tmp_path / "out.yaml")]) == 0
