"""Server-side apply of rendered objects through the `kubernetes` client, field manager "v41mesh".

`plan` decides what is sent where, offline: Namespaces first (everything else lives in them), NetworkPolicies next
(no pod of the mesh ever runs without its ingress rules), then the rendered order (accounts and RBAC, config,
Services, workloads, the rest). `apply` checks the cluster serves every kind before it changes anything, then applies
each object and reports it. Objects that left the manifests are not pruned: delete them by label
(`app.kubernetes.io/part-of=v41mesh`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import msgspec
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from mesh.k8s import ClusterError, ManifestError

FIELD_MANAGER = "v41mesh"
CLUSTER_SCOPED = frozenset(
    {
        "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
        "StorageClass", "PriorityClass", "IngressClass", "RuntimeClass", "CSIDriver", "VolumeAttachment",
        "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "APIService", "Node",
    }
)  # fmt: skip
_FIRST = ("Namespace", "NetworkPolicy")


class ApplyCall(msgspec.Struct, frozen=True):
    """One server-side apply request: PATCH (application/apply-patch+yaml) of `body` at its name and namespace."""

    api_version: str
    kind: str
    name: str
    namespace: str | None
    body: dict[str, Any]

    def describe(self) -> str:
        """kubectl's way of naming it: `deployment.apps/prefill`."""
        group = self.api_version.rpartition("/")[0]
        return f"{self.kind.lower()}{'.' + group if group else ''}/{self.name}"


class SecretRef(msgspec.Struct, frozen=True):
    namespace: str | None
    name: str
    used_by: str


def plan(objects: Iterable[Mapping[str, Any]], *, namespace: str | None = None) -> list[ApplyCall]:
    """The apply calls for rendered objects, in apply order. `namespace` is for objects that name none."""
    calls = []
    for obj in objects:
        meta = obj["metadata"]
        where = meta.get("namespace") or (None if obj["kind"] in CLUSTER_SCOPED else namespace)
        if where is None and obj["kind"] not in CLUSTER_SCOPED:
            raise ManifestError(f"{obj['kind']}/{meta['name']} has no namespace: apply an overlay or pass --namespace")
        body = {**obj, "metadata": {**meta, **({"namespace": where} if where else {})}}
        calls.append(ApplyCall(obj["apiVersion"], obj["kind"], meta["name"], where, body))
    rank = {kind: i for i, kind in enumerate(_FIRST)}
    return sorted(calls, key=lambda c: rank.get(c.kind, len(_FIRST)))  # stable: the rendered order otherwise


def required_secrets(calls: Iterable[ApplyCall]) -> list[SecretRef]:
    """Secrets pods need (non-optional references) that the manifests do not create: they must exist beforehand."""
    calls = list(calls)
    created = {(c.namespace, c.name) for c in calls if c.kind == "Secret"}
    needed: dict[tuple[str | None, str], SecretRef] = {}
    for call in calls:
        for name in _secret_names(call.body):
            if (call.namespace, name) not in created:
                needed.setdefault((call.namespace, name), SecretRef(call.namespace, name, call.describe()))
    return list(needed.values())


def _secret_names(obj: Any) -> Iterator[str]:
    for m in mappings(obj):
        for key in ("secretKeyRef", "secretRef"):
            ref = m.get(key)
            if isinstance(ref, Mapping) and not ref.get("optional", False):
                yield ref["name"]
        secret = m.get("secret")
        if isinstance(secret, Mapping) and "secretName" in secret and not secret.get("optional", False):
            yield secret["secretName"]


def mappings(obj: Any) -> Iterator[dict[str, Any]]:
    """Every mapping inside a nested object, outermost first."""
    if isinstance(obj, dict):
        yield obj
        for value in obj.values():
            yield from mappings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from mappings(value)


def _resource(client: DynamicClient, call: ApplyCall) -> Any:
    try:
        return client.resources.get(api_version=call.api_version, kind=call.kind)
    except ResourceNotFoundError:
        return None


def apply(
    client: DynamicClient,
    calls: list[ApplyCall],
    *,
    dry_run: bool = False,
    force_conflicts: bool = False,
    report: Callable[[ApplyCall, str], None] = lambda call, outcome: None,
) -> list[str]:
    """Apply every call; returns the failures (empty when all were applied). Nothing is sent if a kind is unknown."""
    resources = {(c.api_version, c.kind): _resource(client, c) for c in calls}
    missing = sorted(f"{api} {kind}" for (api, kind), resource in resources.items() if resource is None)
    if missing:
        raise ClusterError(
            f"the cluster does not serve {', '.join(missing)}: install the CRDs they come from (PodMonitor and "
            "ServiceMonitor: the Prometheus Operator; LeaderWorkerSet: the LWS controller) or use an overlay "
            "without them (dev; released for one node a group)"
        )
    failures = []
    for call in calls:
        try:
            client.server_side_apply(
                resources[(call.api_version, call.kind)],
                body=call.body,
                name=call.name,
                namespace=call.namespace,
                field_manager=FIELD_MANAGER,
                force_conflicts=force_conflicts,
                dry_run="All" if dry_run else None,
            )
        except ApiException as exc:
            failures.append(f"{call.describe()}: {_explain(exc)}")
            report(call, "failed")
        else:
            report(call, "serverside-applied" + (" (server dry run)" if dry_run else ""))
    return failures


def missing_secrets(client: DynamicClient, calls: list[ApplyCall]) -> list[SecretRef]:
    """The required secrets (see `required_secrets`) that do not exist in the cluster."""
    secrets = client.resources.get(api_version="v1", kind="Secret")
    absent = []
    for ref in required_secrets(calls):
        try:
            secrets.get(name=ref.name, namespace=ref.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise ClusterError(f"cannot read Secret {ref.name} in {ref.namespace}: {_explain(exc)}") from None
            absent.append(ref)
    return absent


def _explain(exc: ApiException) -> str:
    """The API server's own message, and what to do about the usual refusals."""
    message = exc.reason or ""
    with contextlib.suppress(msgspec.DecodeError, AttributeError):  # a body that is not a Status object
        message = msgspec.json.decode(exc.body or b"{}").get("message", message)
    hints = {
        409: " (another field manager owns these fields: re-run with --force-conflicts to take them over)",
        403: " (your credentials may not apply this kind here)",
        422: " (the API server rejected the object)",
    }
    return f"{exc.status} {message}{hints.get(exc.status or 0, '')}"
