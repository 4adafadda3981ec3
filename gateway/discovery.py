"""Where the prefill and decode replicas are, for the gateway's router.

The router asks `discovery.replicas("prefill")` on every routing decision and gets the replicas that may take new
work now, as an immutable, sorted tuple (cheap: a snapshot swapped in whole when something changes). Two sources:

- `StaticDiscovery`: fixed "host:port" lists from flags (`--prefill`, `--decode`). Outside a cluster, or for a
  headless Service name that DNS resolves to every ready pod.
- `KubernetesDiscovery`: in a pod, watches the EndpointSlices of the prefill and decode Services (label
  `kubernetes.io/service-name`) through the `kubernetes` client, so the router sees every replica by name and can
  route per replica (load-aware). Needs a Role that may list and watch endpointslices (k8s/base/gateway.yaml).

`make_discovery` picks one from the gateway's flags and falls back to static addresses outside a cluster.

Only endpoints that are ready and not terminating are routed to: a draining replica (SIGTERM, readiness
NOT_SERVING) drops out of its slice and finishes what it has. The cache is not discovered: its address list is the
shard ring every client hashes keys over, so it must be the same fixed list everywhere (the mesh-topology ConfigMap).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from mesh.logging import get_logger

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

log = get_logger("gateway")


class DiscoveryError(RuntimeError):
    """Discovery cannot start; the message says what is missing."""


class Replica(msgspec.Struct, frozen=True, order=True):
    """One replica the router may send work to."""

    name: str  # stable identity for logs, metrics and per-replica state: the pod name (or the address)
    address: str  # what to dial: "host:port", "[v6]:port"
    zone: str | None = None


class Discovery(Protocol):
    """The interface the router consumes."""

    def replicas(self, role: Role) -> tuple[Replica, ...]:
        """The replicas of `role` that take new work now, sorted by name; empty when there are none."""
        ...

    def start(self) -> None:
        """Begin (for Kubernetes: the first listing happens here, so errors surface at start-up)."""
        ...

    def close(self) -> None: ...


def parse_address(address: str) -> str:
    """Validate one "host:port" ("[v6]:port") address; returns it stripped."""
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"replica address {address!r} is not host:port")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"replica address {address!r}: write an IPv6 host in brackets, [addr]:port")
    return text


class StaticDiscovery:
    """Fixed replica lists, from flags."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._replicas: dict[Role, tuple[Replica, ...]] = {}
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            parsed = sorted({parse_address(a) for a in addresses})
            if not parsed:
                raise ValueError(f"no {role} address given")
            self._replicas[role] = tuple(Replica(name=a, address=a) for a in parsed)

    def replicas(self, role: Role) -> tuple[Replica, ...]:
        return self._replicas[role]

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


# --- EndpointSlices (discovery.k8s.io/v1), the fields routing needs ---


class _Conditions(msgspec.Struct):
    # The API: a missing `ready` means ready; `terminating` endpoints are draining.
    ready: bool | None = None
    terminating: bool | None = None


class _TargetRef(msgspec.Struct):
    kind: str = ""
    name: str = ""


class _Endpoint(msgspec.Struct, rename="camel"):
    addresses: list[str]
    conditions: _Conditions = msgspec.field(default_factory=_Conditions)
    target_ref: _TargetRef | None = None
    zone: str | None = None


class _Port(msgspec.Struct):
    name: str | None = None
    port: int | None = None


class _Metadata(msgspec.Struct):
    name: str
    labels: dict[str, str] = {}


class EndpointSlice(msgspec.Struct, rename="camel"):
    metadata: _Metadata
    address_type: str = "IPv4"
    endpoints: list[_Endpoint] | None = None
    ports: list[_Port] | None = None


class EndpointTable:
    """The ready replicas per role, kept from EndpointSlice list and watch events (a pure state machine).

    A Service's endpoints may be split over several slices, and during a handover the same endpoint can sit in
    two of them: replicas are the union over the role's slices, one per address.
    """

    def __init__(self, services: Mapping[str, Role], port_name: str = "grpc") -> None:
        self._services = dict(services)  # Service name -> role
        self._port_name = port_name
        self._slices: dict[str, tuple[Role, tuple[Replica, ...]]] = {}  # slice name -> (role, its replicas)
        self._replicas: dict[Role, tuple[Replica, ...]] = dict.fromkeys(self._services.values(), ())

    def replicas(self, role: Role) -> tuple[Replica, ...]:
        return self._replicas[role]

    def apply(self, event_type: str, raw: Mapping[str, Any]) -> set[Role]:
        """One watch event (ADDED, MODIFIED, DELETED; BOOKMARK is ignored); returns the roles whose replicas changed."""
        if event_type == "BOOKMARK":
            return set()
        if event_type not in ("ADDED", "MODIFIED", "DELETED"):
            raise ValueError(f"unexpected watch event type {event_type!r}")
        es = msgspec.convert(raw, EndpointSlice)
        role = self._services.get(es.metadata.labels.get(SERVICE_NAME_LABEL, ""))
        previous = self._slices.pop(es.metadata.name, None)
        if role is not None and event_type != "DELETED":
            self._slices[es.metadata.name] = (role, self._routable(es))
        return self._recompute({r for r in (role, previous and previous[0]) if r is not None})

    def replace_all(self, raws: Iterable[Mapping[str, Any]]) -> set[Role]:
        """A fresh listing: forget every slice not in it (events may have been missed while disconnected)."""
        self._slices.clear()
        for raw in raws:
            es = msgspec.convert(raw, EndpointSlice)
            role = self._services.get(es.metadata.labels.get(SERVICE_NAME_LABEL, ""))
            if role is not None:
                self._slices[es.metadata.name] = (role, self._routable(es))
        return self._recompute(set(self._replicas))

    def _routable(self, es: EndpointSlice) -> tuple[Replica, ...]:
        port = next((p.port for p in es.ports or [] if p.name == self._port_name), None)
        if port is None:
            if es.endpoints:
                log.warning("endpointslice_without_port", slice=es.metadata.name, port_name=self._port_name)
            return ()
        routable = []
        for ep in es.endpoints or []:
            if ep.conditions.ready is False or ep.conditions.terminating:
                continue
            for address in ep.addresses[:1]:  # every address of an endpoint is the same pod
                host = f"[{address}]" if es.address_type == "IPv6" else address
                name = ep.target_ref.name if ep.target_ref and ep.target_ref.name else address
                routable.append(Replica(name=name, address=f"{host}:{port}", zone=ep.zone))
        return tuple(routable)

    def _recompute(self, roles: set[Role]) -> set[Role]:
        changed = set()
        for role in roles:
            by_address: dict[str, Replica] = {}
            for slice_name in sorted(self._slices):
                slice_role, replicas = self._slices[slice_name]
                if slice_role == role:
                    for replica in replicas:
                        by_address.setdefault(replica.address, replica)
            current = tuple(sorted(by_address.values()))
            if current != self._replicas[role]:
                self._replicas[role] = current
                changed.add(role)
        return changed


class KubernetesDiscovery:
    """EndpointSlice watching in a pod: list, then watch until the watch ends, again; back off on errors."""

    def __init__(
        self,
        namespace: str,
        services: Mapping[str, Role] | None = None,
        *,
        port_name: str = "grpc",
        watch_timeout_s: int = 300,
        api: Any = None,
    ) -> None:
        self.namespace = namespace
        self._table = EndpointTable(services or {role: role for role in ROLES}, port_name)
        self._selector = f"{SERVICE_NAME_LABEL} in ({','.join(sorted(services or ROLES))})"
        self._watch_timeout_s = watch_timeout_s
        self._api = api
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: Any = None

    def replicas(self, role: Role) -> tuple[Replica, ...]:
        return self._table.replicas(role)

    def start(self) -> None:
        """List once here (an RBAC or connection problem fails the gateway's start-up), then watch in a thread."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        if self._api is None:
            self._api = client.DiscoveryV1Api()  # the configuration make_discovery loaded in-cluster
        try:
            resource_version = self._list()
        except (ApiException, HTTPError, OSError) as exc:
            raise DiscoveryError(
                f"cannot list EndpointSlices in namespace {self.namespace!r}: {exc}; the gateway's ServiceAccount "
                "needs get/list/watch on discovery.k8s.io endpointslices (Role gateway-discovery, k8s/base)"
            ) from None
        threading.Thread(target=self._run, args=(resource_version,), name="endpointslice-watch", daemon=True).start()

    def close(self) -> None:
        """Stop watching. The thread is a daemon blocked on the watch stream: it is not waited for."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _list(self) -> str:
        response = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self._selector, _preload_content=False
        )
        listing = json.loads(response.data)
        with self._lock:
            changed = self._table.replace_all(listing.get("items") or [])
        self._log_changes(changed)
        return listing["metadata"]["resourceVersion"]

    def _run(self, resource_version: str | None) -> None:
        """Watch from `resource_version`; when the watch ends, list again (after a pause if it failed)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        pause = 0.0
        while not self._stop.wait(pause):
            try:
                if resource_version is None:
                    resource_version = self._list()
                self._watch_from(resource_version)
                resource_version, pause = None, 0.0  # the server ended the watch: list again, nothing is missed
            except (ApiException, HTTPError, OSError, ValueError) as exc:
                resource_version = None
                # 410 Gone (the history was compacted) is cured by a fresh list at once; an API server restarting
                # or network trouble by backing off.
                gone = isinstance(exc, ApiException) and exc.status == 410
                pause = 0.0 if gone else min(max(pause * 2, 1.0), 30.0)
                log.warning("endpointslice_watch_failed", error=str(exc), retry_in_s=pause)

    def _watch_from(self, resource_version: str) -> None:
        from kubernetes import watch

        self._watch = watch.Watch()
        for event in self._watch.stream(
            self._api.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=self._selector,
            resource_version=resource_version,
            timeout_seconds=self._watch_timeout_s,
            allow_watch_bookmarks=True,
        ):
            with self._lock:
                changed = self._table.apply(event["type"], event["raw_object"])
            self._log_changes(changed)

    def _log_changes(self, roles: set[Role]) -> None:
        for role in sorted(roles):
            log.info("replicas_changed", role=role, replicas=[r.name for r in self._table.replicas(role)])


def namespace_in_pod() -> str | None:
    """The pod's own namespace, from its service-account mount."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None


def make_discovery(
    mode: Literal["static", "kubernetes"],
    *,
    prefill: Sequence[str],
    decode: Sequence[str],
    namespace: str | None = None,
) -> Discovery:
    """The discovery the gateway's flags ask for. `kubernetes` outside a cluster falls back to the static lists."""
    if mode == "static":
        return StaticDiscovery(prefill, decode)
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException as exc:
        log.warning("not_in_a_cluster_using_static_replicas", reason=str(exc))
        return StaticDiscovery(prefill, decode)
    namespace = namespace or namespace_in_pod()
    if not namespace:
        raise ValueError("--discovery kubernetes needs --namespace (or the pod's service-account mount)")
    return KubernetesDiscovery(namespace)
