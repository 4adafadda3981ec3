"""Offline validation of rendered objects, strict (unknown fields refused), before they are written or applied.

Built-in kinds: kubernetes-validate's Kubernetes 1.33 schemas. Custom resources are absent from those schemas: they
are checked against the structural schemas below, unknown fields refused, and the API server checks them against the
installed CRDs on apply (`mesh k8s apply --dry-run` too). Any other kind fails.

- The Prometheus Operator's PodMonitor and ServiceMonitor: minimal schemas of the fields the mesh uses.
- LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, the multi-node rank groups): every field of its spec, written from
  the v1 API types of kubernetes-sigs/lws v0.10.0 (api/leaderworkerset/v1/leaderworkerset_types.go: types, enums,
  bounds; the name rule and positive size of its admission webhook). Its pod templates and claim templates are
  Kubernetes objects and are validated as such against the 1.33 schemas, as the CRD itself embeds them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jsonschema
import kubernetes_validate

from mesh.k8s import ManifestError

KUBERNETES_VERSION = "1.33"

_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
# Prometheus durations: 30s, 1m30s, 500ms.
_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
    },
}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def _monitor_schema(kind: str, endpoints_field: str) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", endpoints_field],
                "properties": {
                    "selector": _SELECTOR,
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array"}},
                    },
                    "jobLabel": {"type": "string"},
                    endpoints_field: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    }


LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
# An absolute count or a percentage (intstr), as rollingUpdateConfiguration takes them.
_COUNT_OR_PERCENT = {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%$"}]}
# Pod and claim templates: objects here, validated against the Kubernetes schemas by `_embedded`.
_KUBERNETES_OBJECT = {"type": "object"}
_RESTART_POLICIES = ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None", "Default"]
_LEADER_WORKER_SET: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": LWS_API_VERSION},
        "kind": {"const": "LeaderWorkerSet"},
        # The name also names the group's headless Service and its pods' hostnames: a DNS-1035 label.
        "metadata": {
            **_METADATA,
            "properties": {
                **_METADATA["properties"],
                "name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {**_INT32, "minimum": 0, "maximum": 1_000_000},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "leaderTemplate": _KUBERNETES_OBJECT,
                        "workerTemplate": _KUBERNETES_OBJECT,
                        "size": {**_INT32, "minimum": 1},
                        "restartPolicy": {"enum": _RESTART_POLICIES},
                        "subGroupPolicy": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                                "subGroupSize": {**_INT32, "minimum": 1},
                            },
                        },
                        "volumeClaimTemplates": {"type": "array", "items": _KUBERNETES_OBJECT},
                        "persistentVolumeClaimRetentionPolicy": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "whenDeleted": {"enum": ["Retain", "Delete"]},
                                "whenScaled": {"enum": ["Retain", "Delete"]},
                            },
                        },
                    },
                },
                "rolloutStrategy": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "partition": {**_INT32, "minimum": 0},
                                "maxUnavailable": _COUNT_OR_PERCENT,
                                "maxSurge": _COUNT_OR_PERCENT,
                            },
                        },
                    },
                },
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["subdomainPolicy"],
                    "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
                },
            },
        },
    },
}

CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): _monitor_schema("PodMonitor", "podMetricsEndpoints"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _monitor_schema("ServiceMonitor", "endpoints"),
    (LWS_API_VERSION, "LeaderWorkerSet"): _LEADER_WORKER_SET,
}


class _Embedded(NamedTuple):
    """A Kubernetes object inside a custom resource, wrapped as a built-in kind to be validated as one."""

    path: list[str | int]  # where it is in the custom resource
    wrapper: dict[str, Any]  # the built-in object holding it
    depth: int  # how deep it sits in `wrapper` (error paths below that depth are paths below `path`)


def _embedded(obj: Mapping[str, Any]) -> Iterator[_Embedded]:
    """The Kubernetes objects inside a custom resource that passed its schema: a LeaderWorkerSet's pod templates
    (each the `template` of a PodTemplate) and claim templates (PersistentVolumeClaims)."""
    if (obj["apiVersion"], obj["kind"]) != (LWS_API_VERSION, "LeaderWorkerSet"):
        return
    group = obj["spec"]["leaderWorkerTemplate"]
    where: list[str | int] = ["spec", "leaderWorkerTemplate"]
    meta = {"name": obj["metadata"]["name"]}
    for part in ("leaderTemplate", "workerTemplate"):
        if part in group:
            wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": group[part]}
            yield _Embedded([*where, part], wrapper, depth=1)
    for i, claim in enumerate(group.get("volumeClaimTemplates", [])):
        wrapper = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", **claim}
        yield _Embedded([*where, "volumeClaimTemplates", i], wrapper, depth=0)


def _path(parts: Iterable[str | int]) -> str:
    return ".".join(str(p) for p in parts) or "(root)"


def validate(obj: Mapping[str, Any]) -> None:
    """Validate one object strictly (unknown fields refused) against Kubernetes 1.33, or its custom resource schema
    and then the Kubernetes objects it embeds. ManifestError names the object and the field."""
    kind, api_version = obj.get("kind", "?"), obj.get("apiVersion", "?")
    where = f"{kind}/{obj.get('metadata', {}).get('name', '?')}"
    try:
        crd = CRD_SCHEMAS.get((api_version, kind))
        if crd is None:
            kubernetes_validate.validate(dict(obj), KUBERNETES_VERSION, strict=True)
            return
        jsonschema.Draft202012Validator(crd).validate(obj)
    except kubernetes_validate.SchemaNotFoundError:
        raise ManifestError(f"{where}: no Kubernetes {KUBERNETES_VERSION} schema for {api_version} {kind}") from None
    except jsonschema.ValidationError as exc:
        raise ManifestError(f"{where}: {_path(exc.absolute_path)}: {exc.message}") from None
    for inner in _embedded(obj):
        try:
            kubernetes_validate.validate(inner.wrapper, KUBERNETES_VERSION, strict=True)
        except jsonschema.ValidationError as exc:
            below = list(exc.absolute_path)[inner.depth :]
            raise ManifestError(f"{where}: {_path([*inner.path, *below])}: {exc.message}") from None
