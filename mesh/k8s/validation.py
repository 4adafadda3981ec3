"""Offline validation of rendered objects, strict (unknown fields refused), before they are written or applied.

Built-in kinds: kubernetes-validate's Kubernetes 1.33 schemas. The Prometheus Operator's PodMonitor and
ServiceMonitor are CRDs, absent from those schemas: they are checked against the minimal structural schemas below
(the fields the mesh uses, unknown fields refused); the API server checks them against the installed CRDs on apply
(`mesh k8s apply --dry-run` too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): _monitor_schema("PodMonitor", "podMetricsEndpoints"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _monitor_schema("ServiceMonitor", "endpoints"),
}


def validate(obj: Mapping[str, Any]) -> None:
    """Validate one object strictly (unknown fields refused) against Kubernetes 1.33, or its CRD schema."""
    kind, api_version = obj.get("kind", "?"), obj.get("apiVersion", "?")
    where = f"{kind}/{obj.get('metadata', {}).get('name', '?')}"
    try:
        crd = CRD_SCHEMAS.get((api_version, kind))
        if crd is not None:
            jsonschema.Draft202012Validator(crd).validate(obj)
        else:
            kubernetes_validate.validate(dict(obj), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        raise ManifestError(f"{where}: no Kubernetes {KUBERNETES_VERSION} schema for {api_version} {kind}") from None
    except jsonschema.ValidationError as exc:
        path = ".".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ManifestError(f"{where}: {path}: {exc.message}") from None
