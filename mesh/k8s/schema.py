"""What Kubernetes 1.33 says about our objects, offline: the OpenAPI definitions bundled with kubernetes-validate.

Two uses: strategic-merge patches need each list's merge key (`containers` merge by `name`, container `ports` by
`containerPort`, `tolerations` are replaced whole), and rendered objects are validated strictly before they are
written or applied. The Prometheus Operator's PodMonitor and ServiceMonitor are CRDs, absent from those schemas:
they are checked against the minimal structural schemas below (the fields the mesh uses, unknown fields refused).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

import jsonschema
import kubernetes_validate

from mesh.k8s import ManifestError

KUBERNETES_VERSION = "1.33"
_DEFINITIONS = f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local/_definitions.json"

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


@functools.cache
def _definitions() -> dict[str, Any]:
    text = resources.files("kubernetes_validate").joinpath(_DEFINITIONS).read_text()
    return json.loads(text)["$defs"]


@functools.cache
def _kinds() -> dict[tuple[str, str], str]:
    """(apiVersion, kind) → definition name, from each definition's x-kubernetes-group-version-kind."""
    kinds: dict[tuple[str, str], str] = {}
    for name, definition in _definitions().items():
        for gvk in definition.get("x-kubernetes-group-version-kind", []):
            api_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
            kinds[(api_version, gvk["kind"])] = name
    return kinds


class Node:
    """One position in an object's OpenAPI schema, for walking an object and its patch side by side."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        ref = raw.get("$ref")
        self._raw = _definitions()[ref.rsplit("/", 1)[1]] if ref else raw
        self._strategy = raw.get("x-kubernetes-patch-strategy", "")
        self._merge_key = raw.get("x-kubernetes-patch-merge-key")

    def field(self, name: str) -> Node | None:
        """The schema of field `name` of an object (or of any value of a string-keyed map)."""
        prop = self._raw.get("properties", {}).get(name)
        if prop is None and isinstance(self._raw.get("additionalProperties"), Mapping):
            prop = self._raw["additionalProperties"]
        return Node(prop) if prop is not None else None

    def items(self) -> Node | None:
        item = self._raw.get("items")
        return Node(item) if isinstance(item, Mapping) else None

    @property
    def merge_key(self) -> str | None:
        """The key elements of this list are merged by, or None when a patch replaces the list whole."""
        return self._merge_key if "merge" in self._strategy.split(",") else None


def schema_for(api_version: str, kind: str) -> Node | None:
    """The root schema of a built-in kind, or None for kinds Kubernetes does not define (CRDs)."""
    name = _kinds().get((api_version, kind))
    return Node(_definitions()[name]) if name else None


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
