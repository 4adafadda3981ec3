"""Render a Kustomize overlay without kubectl: the subset of Kustomize the mesh's manifests use, with Kustomize's
semantics and its exact output (the tests compare with `kubectl kustomize` wherever kubectl is installed).

Supported kustomization fields, and nothing else (any other field is refused by name, never ignored):
  resources           files and directories holding a kustomization (built first, recursively)
  configMapGenerator  `literals`, with `behavior` create | merge | replace; names get Kustomize's content hash
  patches             strategic merge or JSON 6902, from `path` or inline `patch`, with an optional `target`
                      (group, version, kind, and anchored regular expressions for name and namespace)
  namespace, labels (`pairs` on metadata.labels), replicas, images (newName, newTag, digest)

Order of work, as in Kustomize: resources, generators, then patches, namespace, labels, replicas and images; and
once the whole tree is built, hash suffixes on generated ConfigMaps (with every reference renamed) and the "legacy"
kind order of `kubectl kustomize`. Stricter than Kustomize where it silently does nothing: a patch target or a
replicas entry that matches no resource is an error.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from mesh.k8s import ManifestError
from mesh.k8s.patches import is_delete, json6902, strategic_merge
from mesh.k8s.schema import schema_for
from mesh.k8s.yaml_io import dump_documents, load_documents, load_yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
CLUSTER_SCOPED = frozenset(
    {
        "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
        "StorageClass", "PriorityClass", "IngressClass", "RuntimeClass", "CSIDriver", "VolumeAttachment",
        "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "APIService", "Node",
    }
)  # fmt: skip
SCALABLE = frozenset({"Deployment", "StatefulSet", "ReplicaSet", "ReplicationController"})

# `kubectl kustomize` orders kinds this way (Kustomize's "legacy" sort); other kinds sort between the two lists.
_ORDER_FIRST = (
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount", "PodSecurityPolicy",
    "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap", "Secret", "Endpoints", "Service",
    "LimitRange", "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment", "StatefulSet",
    "CronJob", "PodDisruptionBudget",
)  # fmt: skip
_ORDER_LAST = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
_KIND_RANK = {kind: i - len(_ORDER_FIRST) for i, kind in enumerate(_ORDER_FIRST)} | {
    kind: i + 1 for i, kind in enumerate(_ORDER_LAST)
}


class _Rule(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    pass


class Target(_Rule):
    group: str | None = None
    version: str | None = None
    kind: str | None = None
    name: str | None = None
    namespace: str | None = None


class PatchRule(_Rule):
    path: str | None = None
    patch: str | None = None
    target: Target | None = None


class ImageRule(_Rule):
    name: str
    new_name: str | None = None
    new_tag: str | None = None
    digest: str | None = None


class ReplicaRule(_Rule):
    name: str
    count: int


class LabelRule(_Rule):
    pairs: dict[str, str]


class ConfigMapRule(_Rule):
    name: str
    behavior: Literal["create", "merge", "replace"] = "create"
    literals: list[str] = []


class Kustomization(_Rule):
    api_version: Literal["kustomize.config.k8s.io/v1beta1"] = "kustomize.config.k8s.io/v1beta1"
    kind: Literal["Kustomization"] = "Kustomization"
    namespace: str | None = None
    resources: list[str] = []
    config_map_generator: list[ConfigMapRule] = []
    patches: list[PatchRule] = []
    labels: list[LabelRule] = []
    replicas: list[ReplicaRule] = []
    images: list[ImageRule] = []


class Resource(msgspec.Struct):
    obj: dict[str, Any]
    generated: bool = False  # made by a generator: its name gets a content hash once the tree is built
    # (namespace, name) as first loaded: what other objects refer to it by, whatever it is renamed to later.
    origin: tuple[str | None, str] = (None, "")

    def __post_init__(self) -> None:
        self.origin = (self.namespace, self.name)

    @property
    def kind(self) -> str:
        return self.obj["kind"]

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]

    @property
    def namespace(self) -> str | None:
        return self.obj["metadata"].get("namespace")

    def describe(self) -> str:
        return f"{self.kind}/{self.name}"


def build(directory: str | Path) -> list[dict[str, Any]]:
    """The objects an overlay renders to, in `kubectl kustomize` order."""
    resources = _accumulate(Path(directory).resolve(), ())
    _add_hash_suffixes(resources)
    _fix_back_references(resources)
    return [r.obj for r in sorted(resources, key=_legacy_order)]


def render(directory: str | Path) -> str:
    """The overlay as one YAML stream, identical to `kubectl kustomize DIRECTORY`."""
    return dump_documents(build(directory))


def load_kustomization(directory: Path) -> tuple[Path, Kustomization]:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            break
    else:
        raise ManifestError(f"{directory}: no kustomization.yaml")
    data = load_yaml(path.read_text(), str(path))
    try:
        return path, msgspec.convert(data if data is not None else {}, Kustomization)
    except msgspec.ValidationError as exc:
        raise ManifestError(
            f"{path}: {exc} (this renderer supports resources, namespace, labels, images, replicas, "
            "configMapGenerator and patches)"
        ) from None


def _accumulate(directory: Path, stack: tuple[Path, ...]) -> list[Resource]:
    if directory in stack:
        raise ManifestError(f"{directory}: resources form a cycle: {' -> '.join(map(str, (*stack, directory)))}")
    path, kust = load_kustomization(directory)
    resources: list[Resource] = []
    for entry in kust.resources:
        for resource in _load_resource(directory, entry, (*stack, directory)):
            _add(resources, resource, str(path))
    for rule in kust.config_map_generator:
        _generate_config_map(resources, rule, str(path))
    for number, patch in enumerate(kust.patches):
        _apply_patch(resources, directory, patch, f"{path}: patches[{number}]")
    if kust.namespace:
        for r in resources:
            if r.kind not in CLUSTER_SCOPED:
                r.obj["metadata"]["namespace"] = kust.namespace
    for label in kust.labels:
        for r in resources:
            r.obj["metadata"].setdefault("labels", {}).update(label.pairs)
    for replica in kust.replicas:
        _set_replicas(resources, replica, str(path))
    for image in kust.images:
        for r in resources:
            _set_image(r.obj, image)
    return resources


def _load_resource(directory: Path, entry: str, stack: tuple[Path, ...]) -> list[Resource]:
    if "://" in entry:
        raise ManifestError(f"{directory}: remote resource {entry!r} is not supported; vendor it into the tree")
    path = (directory / entry).resolve()
    if path.is_dir():
        return _accumulate(path, stack)
    if not path.is_file():
        raise ManifestError(f"{directory}: resource {entry!r} does not exist")
    resources = []
    for number, obj in enumerate(load_documents(path.read_text(), str(path))):
        if not (obj.get("apiVersion") and obj.get("kind") and isinstance(obj.get("metadata"), dict)):
            raise ManifestError(f"{path}: document {number} needs apiVersion, kind and metadata")
        if not obj["metadata"].get("name"):
            raise ManifestError(f"{path}: document {number} ({obj['kind']}) has no metadata.name")
        resources.append(Resource(obj))
    return resources


def _identity(r: Resource) -> tuple[str, str, str | None, str]:
    return (r.obj["apiVersion"], r.kind, r.namespace, r.name)


def _add(resources: list[Resource], resource: Resource, where: str) -> None:
    if any(_identity(r) == _identity(resource) for r in resources):
        raise ManifestError(f"{where}: {resource.describe()} is defined twice")
    resources.append(resource)


# --- generators ---


def _generate_config_map(resources: list[Resource], rule: ConfigMapRule, where: str) -> None:
    data: dict[str, str] = {}
    for literal in rule.literals:
        key, sep, value = literal.partition("=")
        if not sep or not key:
            raise ManifestError(f"{where}: configMapGenerator {rule.name}: literal {literal!r} is not KEY=VALUE")
        data[key] = value
    existing = [r for r in resources if r.kind == "ConfigMap" and r.name == rule.name]
    if rule.behavior == "create":
        if existing:
            raise ManifestError(f"{where}: ConfigMap {rule.name} already exists; use `behavior: merge` or `replace`")
        obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": rule.name}} | (
            {"data": data} if data else {}
        )
        resources.append(Resource(obj, generated=True))
        return
    if not existing:
        raise ManifestError(f"{where}: ConfigMap {rule.name} to {rule.behavior} is not generated by any resource")
    for r in existing:
        r.obj["data"] = (r.obj.get("data", {}) if rule.behavior == "merge" else {}) | data


def _config_map_hash(obj: dict[str, Any]) -> str:
    """Kustomize's name suffix: the first 10 hex digits of a SHA-256 over its JSON encoding, made unpronounceable.

    Kustomize looks the name up under a path it never finds, so the name enters the hash as "": we do the same,
    or our names would differ from `kubectl kustomize`'s.
    """
    encoded: dict[str, Any] = {"kind": "ConfigMap", "name": "", "data": obj.get("data") or ""}
    if obj.get("binaryData"):
        encoded["binaryData"] = obj["binaryData"]
    # Go's encoding/json: sorted keys, no spaces, HTML characters escaped, other Unicode raw.
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _add_hash_suffixes(resources: list[Resource]) -> None:
    for r in resources:
        if r.generated:
            r.obj["metadata"]["name"] = f"{r.name}-{_config_map_hash(r.obj)}"


def _fix_back_references(resources: list[Resource]) -> None:
    """Point references at the objects' final names and namespaces, as Kustomize does once the tree is built:
    pod templates at hashed ConfigMaps, (Cluster)RoleBinding subjects at their ServiceAccounts."""
    config_maps = {(r.namespace, r.origin[1]): r.name for r in resources if r.kind == "ConfigMap"}
    accounts = {r.origin: r for r in resources if r.kind == "ServiceAccount"}
    for r in resources:
        for ref in _config_map_refs(r.obj):
            ref["name"] = config_maps.get((r.namespace, ref["name"]), ref["name"])
        if r.kind not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        for subject in r.obj.get("subjects", []):
            account = accounts.get((subject.get("namespace"), subject.get("name", "")))
            if subject.get("kind") == "ServiceAccount" and account is not None:
                subject["name"] = account.name
                if account.namespace is not None:
                    subject["namespace"] = account.namespace


def _config_map_refs(obj: Any) -> Iterator[dict[str, Any]]:
    """Every place a pod template names a ConfigMap: env, envFrom, and (projected) volumes."""
    for spec in _pod_specs(obj):
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref and "name" in ref:
                    yield ref
            for source in container.get("envFrom", []):
                if "name" in source.get("configMapRef", {}):
                    yield source["configMapRef"]
        for volume in spec.get("volumes", []):
            sources = [volume, *volume.get("projected", {}).get("sources", [])]
            yield from (s["configMap"] for s in sources if "name" in s.get("configMap", {}))


def mappings(obj: Any) -> Iterator[dict[str, Any]]:
    """Every mapping inside a nested object, outermost first."""
    if isinstance(obj, dict):
        yield obj
        for value in obj.values():
            yield from mappings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from mappings(value)


def _pod_specs(obj: Any) -> Iterator[dict[str, Any]]:
    """Pod specs anywhere in an object (Pod, Deployment, StatefulSet, Job, CronJob ...)."""
    return (m for m in mappings(obj) if isinstance(m.get("containers"), list))


# --- transformers ---


def _selected(target: Target, r: Resource) -> bool:
    group, _, version = r.obj["apiVersion"].rpartition("/")
    return (
        (target.group is None or target.group == group)
        and (target.version is None or target.version == version)
        and (target.kind is None or target.kind == r.kind)
        and (target.name is None or re.fullmatch(target.name, r.name) is not None)
        and (target.namespace is None or re.fullmatch(target.namespace, r.namespace or "") is not None)
    )


def _patch_content(directory: Path, rule: PatchRule, where: str) -> Any:
    if (rule.path is None) == (rule.patch is None):
        raise ManifestError(f"{where}: give exactly one of `path` and `patch`")
    if rule.path is not None:
        path = directory / rule.path
        if not path.is_file():
            raise ManifestError(f"{where}: patch file {rule.path!r} does not exist")
        text, where = path.read_text(), f"{where} ({rule.path})"
    else:
        text = rule.patch or ""
    try:
        documents = [d for d in yaml.compose_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{where}: not valid YAML: {exc}") from None
    if len(documents) != 1:
        # Kustomize itself crashes on several documents in one `patches` entry.
        raise ManifestError(f"{where}: one patch per entry, got {len(documents)} YAML documents")
    return load_yaml(text, where)


def _apply_patch(resources: list[Resource], directory: Path, rule: PatchRule, where: str) -> None:
    patch = _patch_content(directory, rule, where)
    if isinstance(patch, list):
        if rule.target is None:
            raise ManifestError(f"{where}: a JSON 6902 patch needs a `target`")
        targets = [r for r in resources if _selected(rule.target, r)]
    elif isinstance(patch, dict):
        targets = _strategic_targets(resources, rule, patch, where)
    else:
        raise ManifestError(f"{where}: a patch is a mapping (strategic merge) or a list (JSON 6902)")
    if not targets:
        raise ManifestError(f"{where}: the patch matches no resource")
    for r in targets:
        if isinstance(patch, list):
            r.obj = json6902(r.obj, patch, f"{where} on {r.describe()}")
        elif is_delete(patch):
            resources.remove(r)
        else:
            # The target names the objects; the patch's own identity fields are not content.
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            body["metadata"] = {k: v for k, v in patch.get("metadata", {}).items() if k not in ("name", "namespace")}
            try:
                r.obj = strategic_merge(r.obj, body, schema_for(r.obj["apiVersion"], r.kind))
            except ManifestError as exc:
                raise ManifestError(f"{where} on {r.describe()}: {exc}") from None


def _strategic_targets(resources: list[Resource], rule: PatchRule, patch: dict[str, Any], where: str) -> list[Resource]:
    if rule.target is not None:
        return [r for r in resources if _selected(rule.target, r)]
    kind, name = patch.get("kind"), patch.get("metadata", {}).get("name")
    if not kind or not name:
        raise ManifestError(f"{where}: a strategic-merge patch without `target` needs kind and metadata.name")
    namespace = patch["metadata"].get("namespace")
    return [r for r in resources if r.kind == kind and r.name == name and namespace in (None, r.namespace)]


def _set_replicas(resources: list[Resource], rule: ReplicaRule, where: str) -> None:
    matches = [r for r in resources if r.kind in SCALABLE and r.name == rule.name]
    if not matches:
        raise ManifestError(f"{where}: replicas: no Deployment or StatefulSet named {rule.name!r}")
    for r in matches:
        r.obj.setdefault("spec", {})["replicas"] = rule.count


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    """`registry:5000/repo/name:tag@sha256:...` → (name, tag, digest)."""
    name, _, digest = image.partition("@")
    colon = name.rfind(":")
    if colon > name.rfind("/"):
        return name[:colon], name[colon + 1 :], digest or None
    return name, None, digest or None


def _set_image(obj: dict[str, Any], rule: ImageRule) -> None:
    for spec in _pod_specs(obj):
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            name, tag, digest = _split_image(container.get("image", ""))
            if name != rule.name:
                continue
            name = rule.new_name or name
            if rule.digest:
                container["image"] = f"{name}@{rule.digest}"
            elif rule.new_tag:
                container["image"] = f"{name}:{rule.new_tag}"
            else:
                container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _legacy_order(r: Resource) -> tuple[int, str, str]:
    group, _, version = r.obj["apiVersion"].rpartition("/")
    gvk = "_".join((group or "~G", version or "~V", r.kind or "~K"))
    res_id = "|".join((f"{r.kind}.{version or '[noVer]'}.{group or '[noGrp]'}", r.namespace or "~X", r.name))
    return (_KIND_RANK.get(r.kind, 0), gvk, res_id)
