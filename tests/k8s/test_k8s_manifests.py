"""Every rendered object of every overlay: valid against Kubernetes 1.33, and true to the deployment's rules."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from k8s_helpers import (
    COMPONENT,
    GPU_OVERLAYS,
    RANK_GROUP_OVERLAYS,
    RANKS,
    ROLES,
    container_ports,
    containers,
    env_value,
    flag,
    is_group_worker,
    named,
    of_kind,
    pod_spec,
    quantity,
    rendered,
    role_of,
    selected_workloads,
    selects,
    workload,
    workloads,
)

from gateway.affinity import SESSION_HEADERS
from mesh.k8s import ManifestError
from mesh.k8s.validation import CRD_SCHEMAS, validate

GPU_ROLES = ("prefill", "decode")
HEALTH_SERVICES = {"prefill": "prefill.v1.Prefill", "decode": "decode.v1.Decode", "cache": "cache.v1.KvCache"}
GPU = "nvidia.com/gpu"
# Volume types the restricted Pod Security Standard allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}  # fmt: skip


# --- schemas ---


def test_every_object_validates_against_kubernetes_1_33(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        validate(obj)  # raises ManifestError naming the object and field


def test_the_monitor_schemas_cover_the_crds_and_refuse_typos(objects: list[dict[str, Any]]) -> None:
    crds = [o for o in objects if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]
    assert {o["kind"] for o in crds} <= {"PodMonitor", "ServiceMonitor", "LeaderWorkerSet"}
    for obj in (o for o in crds if o["kind"] != "LeaderWorkerSet"):  # LWS: test_k8s_rank_groups.py
        broken = copy.deepcopy(obj)
        broken["spec"]["podMetricEndpoints" if obj["kind"] == "PodMonitor" else "endpoint"] = []
        with pytest.raises(ManifestError, match="Additional properties"):
            validate(broken)


def test_strict_validation_catches_a_misspelt_field() -> None:
    deployment = copy.deepcopy(workload(rendered("dev"), "gateway"))
    pod_spec(deployment)["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(ManifestError, match=r"Deployment/gateway: spec\.template\.spec\.containers\.0"):
        validate(deployment)


# --- probes, ports, drain ---


def test_every_container_has_startup_readiness_and_liveness_probes_on_its_own_ports(
    objects: list[dict[str, Any]],
) -> None:
    for w, c in containers(objects):
        ports = container_ports(w)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            assert probe, f"{role_of(w)} has no {kind}"
            handler = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
            port = handler["port"]
            assert port in ports or port in ports.values(), f"{role_of(w)} {kind} probes undeclared port {port}"


def test_grpc_readiness_asks_for_the_roles_own_service_and_the_gateway_for_health(
    objects: list[dict[str, Any]],
) -> None:
    for w, c in containers(objects):
        role = role_of(w)
        if role == "gateway":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            # Liveness must not restart a gateway whose backends are down: /live answers while the process runs.
            assert c["livenessProbe"]["httpGet"]["path"] == "/live"
            assert c["startupProbe"]["httpGet"]["path"] == "/live"
        elif is_group_worker(w):
            # Workers of a rank group serve no gRPC: every probe checks the metrics port they do serve.
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[kind]["tcpSocket"] == {"port": "metrics"}, kind
        else:
            assert c["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICES[role]
            # Liveness must not kill a replica that reports NOT_SERVING while it drains.
            assert "tcpSocket" in c["livenessProbe"]


def test_gpu_roles_have_a_long_startup_budget_for_weight_loading(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        if role_of(w) in GPU_ROLES:
            probe = pod_spec(w)["containers"][0]["startupProbe"]
            assert probe["periodSeconds"] * probe["failureThreshold"] >= 20 * 60


def test_port_flags_match_declared_container_ports(objects: list[dict[str, Any]]) -> None:
    for w, c in containers(objects):
        declared = sorted(p["containerPort"] for p in c["ports"])
        served = sorted(int(flag(c["args"], f)) for f in ("--port", "--grpc-port", "--metrics-port") if f in c["args"])
        assert served == declared, f"{role_of(w)}: flags serve {served}, container declares {declared}"
        assert flag(c["args"], "--host") == "0.0.0.0"
        assert c["args"][:2] == [f"{role_of(w)}_svc" if role_of(w) != "gateway" else "gateway", "serve"]


def test_grace_periods_cover_the_drain(objects: list[dict[str, Any]]) -> None:
    grace = {role_of(w): pod_spec(w)["terminationGracePeriodSeconds"] for w in workloads(objects)}
    for w, c in containers(objects):
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        # Services drain for up to 30 s after SIGTERM (the cache's grace_s default), after the preStop pause.
        assert grace[role_of(w)] >= pre_stop + 30 + 10
    assert grace["decode"] >= 120, "a long generation needs minutes to finish"
    assert grace["gateway"] >= grace["decode"], "client streams pass through the gateway"


# --- resources and GPUs ---


def test_every_container_has_requests_and_limits_with_guaranteed_memory(objects: list[dict[str, Any]]) -> None:
    for w, c in containers(objects):
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        for resource in ("cpu", "memory"):
            assert quantity(requests[resource]) <= quantity(limits[resource]), f"{role_of(w)} {resource}"
        assert quantity(requests["memory"]) == quantity(limits["memory"]), f"{role_of(w)} memory"


def test_gpus_are_requested_only_by_prefill_and_decode_with_requests_equal_to_limits_and_ranks(
    overlay: str, objects: list[dict[str, Any]]
) -> None:
    """One GPU a pod for `small` (gpu); rank groups of 8 (decode) and 4 (prefill) for the released checkpoint, each
    rank process on a GPU of its own: `--ranks` equals the GPUs requested."""
    for w, c in containers(objects):
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        wants_gpu = overlay in GPU_OVERLAYS and role_of(w) in GPU_ROLES
        assert (GPU in limits) == wants_gpu, role_of(w)
        assert (GPU in requests) == wants_gpu, role_of(w)
        if wants_gpu:
            gpus = RANKS[role_of(w)] if overlay in RANK_GROUP_OVERLAYS else 1
            assert requests[GPU] == limits[GPU] == gpus
            assert int(flag(c["args"], "--ranks") or 1) == gpus
        else:
            assert flag(c["args"], "--ranks") is None


def test_gpu_scheduling_fields_only_where_gpus_are(overlay: str, objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        spec, role = pod_spec(w), role_of(w)
        on_gpu = overlay in GPU_OVERLAYS and role in GPU_ROLES
        tolerated = any(t.get("key") == GPU for t in spec.get("tolerations", []))
        assert tolerated == on_gpu, role
        assert (spec.get("nodeSelector", {}).get(f"{GPU}.present") == "true") == on_gpu, role
        if on_gpu:
            terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            (term,) = terms["nodeSelectorTerms"]
            products = term["matchExpressions"][0]
            assert products["key"] == f"{GPU}.product"
            assert {"NVIDIA-H100-80GB-HBM3", "NVIDIA-H200"} <= set(products["values"])
        else:
            assert "nvidia" not in str(spec), f"{role} carries GPU fields in {overlay}"


def test_gpu_roles_get_a_memory_backed_dev_shm_within_their_memory_limit(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        if role_of(w) not in GPU_ROLES:
            continue
        spec = pod_spec(w)
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        # A memory-backed emptyDir counts against the container's memory limit.
        limit = quantity(spec["containers"][0]["resources"]["limits"]["memory"])
        assert quantity(volume["emptyDir"]["sizeLimit"]) <= limit / 2


# --- security ---


def test_pods_run_as_non_root_with_a_read_only_root_and_no_privileges(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        spec = pod_spec(w)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["runAsUser"] > 0
        assert pod["runAsGroup"] > 0
        assert pod["seccompProfile"]["type"] == "RuntimeDefault"
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
        for volume in spec.get("volumes", []):
            assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, volume
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert not sc.get("privileged")
            # With a read-only root, writable scratch space must be mounted.
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}


def test_the_namespace_enforces_the_restricted_pod_security_standard(objects: list[dict[str, Any]]) -> None:
    (namespace,) = of_kind(objects, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert all(o["metadata"].get("namespace") == namespace["metadata"]["name"] for o in objects if o is not namespace)


def test_only_the_gateway_gets_an_api_token_and_it_may_only_read_endpointslices(
    objects: list[dict[str, Any]],
) -> None:
    for w in workloads(objects):
        spec = pod_spec(w)
        assert spec["automountServiceAccountToken"] is (role_of(w) == "gateway")
    gateway = pod_spec(workload(objects, "gateway"))
    (binding,) = [
        b for b in of_kind(objects, "RoleBinding") if {"kind": "ServiceAccount", "name": gateway["serviceAccountName"]}
        in [{k: s[k] for k in ("kind", "name")} for s in b["subjects"]]
    ]  # fmt: skip
    assert binding["subjects"][0]["namespace"] == binding["metadata"]["namespace"]
    role = named(objects, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]
    container = gateway["containers"][0]
    assert env_value(container, "GATEWAY_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


# --- the cache: volumes, sizes, the shard ring ---


def test_cache_is_a_parallel_statefulset_with_a_retained_volume_per_replica_at_its_data_dir(
    overlay: str, objects: list[dict[str, Any]]
) -> None:
    sts = workload(objects, "cache")
    assert sts["kind"] == "StatefulSet"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    container = pod_spec(sts)["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert mount["mountPath"] == flag(container["args"], "--data-dir")
    assert ("storageClassName" in claim["spec"]) == (overlay in GPU_OVERLAYS), "the gpu overlays name a fast class"
    service = named(objects, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_cache_capacities_fit_its_volume_and_memory(objects: list[dict[str, Any]]) -> None:
    sts = workload(objects, "cache")
    container = pod_spec(sts)["containers"][0]
    size = {name: int(env_value(container, f"CACHE_SVC_{name}")["value"]) for name in ("DRAM_BYTES", "RECORD_BYTES")}
    volume = quantity(sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"])
    assert int(env_value(container, "CACHE_SVC_SSD_BYTES")["value"]) <= 0.9 * volume
    assert size["DRAM_BYTES"] + size["RECORD_BYTES"] <= 0.8 * quantity(container["resources"]["limits"]["memory"])
    assert float(env_value(container, "CACHE_SVC_RETENTION_HOURS")["value"]) >= 72


def test_every_client_hashes_over_the_same_ring_of_every_cache_pod(objects: list[dict[str, Any]]) -> None:
    sts = workload(objects, "cache")
    port = container_ports(sts)["grpc"]
    ring = [f"cache-{i}.{sts['spec']['serviceName']}:{port}" for i in range(sts["spec"]["replicas"])]
    for role in ("gateway", "prefill", "decode"):
        container = pod_spec(workload(objects, role))["containers"][0]
        ref = env_value(container, f"{role.upper()}_SVC_CACHE" if role != "gateway" else "GATEWAY_CACHE")
        config_map = named(objects, "ConfigMap", ref["valueFrom"]["configMapKeyRef"]["name"])
        assert config_map["data"][ref["valueFrom"]["configMapKeyRef"]["key"]].split(",") == ring, role


def test_gateway_static_addresses_name_headless_services_on_their_grpc_ports(objects: list[dict[str, Any]]) -> None:
    container = pod_spec(workload(objects, "gateway"))["containers"][0]
    for role in ("prefill", "decode"):
        ref = env_value(container, f"GATEWAY_{role.upper()}")["valueFrom"]["configMapKeyRef"]
        host, port = named(objects, "ConfigMap", ref["name"])["data"][ref["key"]].split(":")
        service = named(objects, "Service", host)
        assert service["spec"]["clusterIP"] == "None"
        assert {"name": "grpc", "port": int(port)}.items() <= next(
            p for p in service["spec"]["ports"] if p["name"] == "grpc"
        ).items()
    discovery = env_value(container, "GATEWAY_DISCOVERY")["valueFrom"]["configMapKeyRef"]
    assert named(objects, "ConfigMap", discovery["name"])["data"][discovery["key"]] == "kubernetes"


# --- references between objects ---


def test_config_and_secret_references_resolve(overlay: str, objects: list[dict[str, Any]]) -> None:
    for w, c in containers(objects):
        for entry in c.get("env", []):
            ref = entry.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["key"] in named(objects, "ConfigMap", ref["name"])["data"], (role_of(w), entry["name"])
    api_key = env_value(pod_spec(workload(objects, "gateway"))["containers"][0], "GATEWAY_API_KEY")
    secret = api_key["valueFrom"]["secretKeyRef"]
    assert secret["name"] == "gateway-api-key"
    # The key comes from a Secret the operator creates; only the dev overlay runs without one.
    assert secret.get("optional", False) is (overlay == "dev")


@pytest.mark.parametrize(
    ("overlay", "store", "least_gi"),
    [("released", "host", 256), ("released-mmap", "mmap", 64), ("multinode", "host", 256)],
)
def test_released_overlays_size_host_memory_for_where_the_engram_tables_live(
    overlay: str, store: str, least_gi: int
) -> None:
    """Host tables: ≥ 256 GiB per prefill and decode pod (the two ≈ 98 GB tables and the process); mapped ones: the
    page cache holds them, the pod less. Both read the checkpoint from a read-only volume at /models."""
    objects = rendered(overlay)
    for role in GPU_ROLES:
        spec = pod_spec(workload(objects, role))
        container = spec["containers"][0]
        ref = env_value(container, f"{role.upper()}_SVC_ENGRAM_STORE")["valueFrom"]["configMapKeyRef"]
        assert named(objects, "ConfigMap", ref["name"])["data"][ref["key"]] == store
        memory = quantity(container["resources"]["limits"]["memory"])
        assert memory >= least_gi * 2**30
        assert (memory >= 256 * 2**30) == (store == "host")
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["checkpoint"]["mountPath"] == "/models"
        assert mounts["checkpoint"]["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == "checkpoint"]
        assert volume["persistentVolumeClaim"] == {"claimName": "v41mesh-checkpoint", "readOnly": True}


def test_model_comes_from_the_model_config_map(overlay: str, objects: list[dict[str, Any]]) -> None:
    for role in GPU_ROLES:
        container = pod_spec(workload(objects, role))["containers"][0]
        ref = env_value(container, f"{role.upper()}_SVC_MODEL")["valueFrom"]["configMapKeyRef"]
        model = named(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        assert model == {"dev": "tiny", "gpu": "small"}.get(overlay, "/models/ckpt")


def test_workload_selectors_match_their_own_pods_and_no_other_workloads(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        if "selector" in w["spec"]:  # a LeaderWorkerSet's controller makes its own
            assert selected_workloads(objects, w["spec"]["selector"]) == [w]
        for constraint in pod_spec(w).get("topologySpreadConstraints", []):
            assert selected_workloads(objects, constraint["labelSelector"]) == [w]


def test_services_select_one_workload_and_target_its_ports(objects: list[dict[str, Any]]) -> None:
    for service in of_kind(objects, "Service"):
        (w,) = selected_workloads(objects, {"matchLabels": service["spec"]["selector"]})
        ports = container_ports(w)
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports or target in ports.values(), f"Service {service['metadata']['name']}: {target}"
            assert ports.get(target, target) == port["port"], "Service and container ports agree"
    assert {s["metadata"]["name"] for s in of_kind(objects, "Service")} == set(ROLES)


def test_disruption_budgets_cover_every_role_one_pod_at_a_time(objects: list[dict[str, Any]]) -> None:
    """One budget a role, covering all its pods (a rank group's leaders and workers alike: evicting either ends the
    group, so one pod at a time is one group at a time)."""
    covered = []
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        selected = selected_workloads(objects, pdb["spec"]["selector"])
        (role,) = {role_of(w) for w in selected}
        assert selected == [w for w in workloads(objects) if role_of(w) == role]
        assert pdb["spec"]["maxUnavailable"] == 1
        covered.append(role)
    assert sorted(covered) == sorted(ROLES)


def test_one_pinned_image_everywhere(overlay: str, objects: list[dict[str, Any]]) -> None:
    images = {c["image"] for _, c in containers(objects)}
    (image,) = images
    name, _, tag = image.rpartition(":")
    assert name == "ghcr.io/v41mesh/v41mesh"
    assert tag == ("0.1.0-cpu" if overlay == "dev" else "0.1.0-cuda")


# --- conversations across gateway replicas ---


def test_the_gateway_service_keeps_a_client_on_one_gateway_while_its_swa_records_live(
    objects: list[dict[str, Any]],
) -> None:
    """Gateways agree on a conversation's replicas by hashing it; the write-back its previous turn left in flight is
    known to one gateway only. A client keeps its gateway at least as long as the cache keeps SWA records."""
    spec = named(objects, "Service", "gateway")["spec"]
    assert spec["sessionAffinity"] == "ClientIP"
    cache = pod_spec(workload(objects, "cache"))["containers"][0]
    record_ttl_s = float(env_value(cache, "CACHE_SVC_RECORD_TTL_S")["value"])
    assert spec["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] >= record_ttl_s


def test_the_ingress_hashes_a_request_onto_a_gateway_by_every_session_header_the_gateway_reads() -> None:
    """ingress-nginx sends to the pods itself (no ClientIP affinity there) and sees only its own clients: it must
    hash on the session, then the client's address, for a conversation's turns to meet on one gateway."""
    (ingress,) = of_kind(rendered("gpu"), "Ingress")
    hash_by = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
    headers = ["http_" + name.replace("-", "_") for name in SESSION_HEADERS]
    assert re.findall(r"\$(\w+)", hash_by) == [*headers, "remote_addr"]


# --- network policies ---


def _ingress_policies(objects: list[dict[str, Any]], labels: dict[str, str]) -> list[dict[str, Any]]:
    return [
        p
        for p in of_kind(objects, "NetworkPolicy")
        if "Ingress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], labels)
    ]


def test_every_pod_is_behind_a_default_deny_ingress_policy(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        policies = _ingress_policies(objects, w["spec"]["template"]["metadata"]["labels"])
        assert any(not p["spec"].get("ingress") for p in policies), f"{role_of(w)} has no default deny"


def test_only_the_gateway_is_reachable_from_outside_and_only_mesh_members_reach_the_cache(
    objects: list[dict[str, Any]],
) -> None:
    """Ports by name, peers by role. The one rule without ports: the pods of a multi-node rank group reach each
    other (NCCL listens on ephemeral ports), and only the pods of that role, only where its pods form such groups."""
    mesh_pods = [(role_of(w), w["spec"]["template"]["metadata"]["labels"]) for w in workloads(objects)]
    grouped = {role_of(w) for w in workloads(objects) if is_group_worker(w)}
    for w in workloads(objects):
        role = role_of(w)
        ports = {name for v in workloads(objects) if role_of(v) == role for name in container_ports(v)}
        for policy in _ingress_policies(objects, w["spec"]["template"]["metadata"]["labels"]):
            for rule in policy["spec"].get("ingress", []):
                rule_ports = [p["port"] for p in rule.get("ports", [])]
                if not rule_ports:
                    assert role in grouped, f"{role}: {policy['metadata']['name']} opens every port"
                    assert all(set(peer) == {"podSelector"} for peer in rule["from"]), "pods of this namespace only"
                    peers = {
                        r for r, labels in mesh_pods for peer in rule["from"] if selects(peer["podSelector"], labels)
                    }
                    assert peers == {role}, f"{role}: every port open to {peers}"
                    continue
                assert all(p in ports for p in rule_ports), f"{role}: {policy['metadata']['name']}: {rule_ports}"
                if not rule.get("from"):
                    assert role == "gateway", f"{role} is open to everyone through {policy['metadata']['name']}"
                    continue
                for peer in rule["from"]:
                    if "namespaceSelector" in peer:  # Prometheus, on the metrics port only
                        assert rule_ports == ["metrics"]
                        assert peer["namespaceSelector"]["matchLabels"]
                        continue
                    allowed = {r for r, labels in mesh_pods if selects(peer["podSelector"], labels)}
                    expected = {"cache": {"gateway", "prefill", "decode"}}.get(role, {"gateway"})
                    assert allowed == expected, f"{role} reachable from {allowed}"


# --- scaling and monitoring ---


def test_gpu_overlay_autoscales_on_queue_depth_and_leaves_replicas_to_the_autoscalers(
    objects: list[dict[str, Any]],
) -> None:
    objects = rendered("gpu")
    scaled = {}
    for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
        target = named(objects, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
        (metric,) = hpa["spec"]["metrics"]
        scaled[role_of(target)] = metric["pods"]["metric"]["name"]
        assert "replicas" not in target["spec"], "a re-apply must not reset what the autoscaler chose"
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert scaled == {role: f"v41mesh_{role}_queue_depth" for role in ("gateway", "prefill", "decode")}


def test_gpu_overlay_scrapes_every_role_on_a_declared_port(objects: list[dict[str, Any]]) -> None:
    objects = rendered("gpu")
    scraped = set()
    for monitor in of_kind(objects, "PodMonitor"):
        for w in selected_workloads(objects, monitor["spec"]["selector"]):
            assert all(e["port"] in container_ports(w) for e in monitor["spec"]["podMetricsEndpoints"])
            scraped.add(role_of(w))
    for monitor in of_kind(objects, "ServiceMonitor"):
        for service in of_kind(objects, "Service"):
            if selects(monitor["spec"]["selector"], service["metadata"].get("labels", {})):
                names = {p["name"] for p in service["spec"]["ports"]}
                assert all(e["port"] in names for e in monitor["spec"]["endpoints"])
                scraped.add(service["metadata"]["labels"][COMPONENT])
    assert scraped == set(ROLES)


def test_dev_runs_one_replica_of_each_role_without_autoscalers_or_crds() -> None:
    objects = rendered("dev")
    assert {role_of(w): w["spec"]["replicas"] for w in workloads(objects)} == dict.fromkeys(ROLES, 1)
    assert not [o for o in objects if o["kind"] in ("HorizontalPodAutoscaler", "PodMonitor", "ServiceMonitor")]
