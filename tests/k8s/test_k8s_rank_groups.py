"""Prefill and decode as rank groups (DESIGN §10): pods of 8 and 4 GPUs for the released checkpoint. Rendering
only: the services' side of the contract (--ranks) is tested with the services."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import (
    RANK_GROUP_OVERLAYS,
    RANKS,
    env_value,
    flag,
    of_kind,
    pod_spec,
    quantity,
    rendered,
    role_of,
    selects,
    workload,
    workloads,
)

GPU = "nvidia.com/gpu"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Host memory of one rank process besides the Engram tables: CUDA context, torch, pinned staging buffers, the
# scheduler on rank 0. An estimate until a group has run on an 8-GPU node (k8s/README.md, Sizes).
PER_RANK_HOST_GIB = 10
SXM_PRODUCTS = {"NVIDIA-H100-80GB-HBM3", "NVIDIA-H200"}


def _rank_group_pods(overlay: str) -> list[dict[str, Any]]:
    return [w for w in workloads(rendered(overlay)) if role_of(w) in RANKS]


def _labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


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
