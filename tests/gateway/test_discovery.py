"""Replica discovery for the gateway's router: the EndpointSlice state machine on its own inputs, static lists, the
fallback outside a cluster, and the list/watch loop through the real `kubernetes` client against a loopback
stand-in of the one API endpoint it uses (no cluster here)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes
import pytest

from gateway.discovery import (
    DiscoveryError,
    EndpointTable,
    KubernetesDiscovery,
    Replica,
    StaticDiscovery,
    make_discovery,
)


def endpoint(ip: str, pod: str, *, ready: bool | None = True, terminating: bool = False) -> dict[str, Any]:
    conditions: dict[str, Any] = {"serving": True, "terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {
        "addresses": [ip],
        "conditions": conditions,
        "nodeName": "gpu-node-1",
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "v41mesh", "uid": f"uid-{pod}"},
        "zone": "zone-a",
    }


def endpoint_slice(name: str, service: str, endpoints: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """An EndpointSlice as the API server returns it (discovery.k8s.io/v1)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "v41mesh",
            "resourceVersion": "100",
            "labels": {"kubernetes.io/service-name": service, "endpointslice.kubernetes.io/managed-by": "x"},
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "grpc", "port": 7002, "protocol": "TCP"}, {"name": "metrics", "port": 9102}],
    } | extra


@pytest.fixture
def table() -> EndpointTable:
    return EndpointTable({"prefill": "prefill", "decode": "decode"})


def test_ready_endpoints_become_replicas_named_by_pod(table: EndpointTable) -> None:
    changed = table.apply("ADDED", endpoint_slice("prefill-abc", "prefill", [
        endpoint("10.0.0.2", "prefill-7d9-b"), endpoint("10.0.0.1", "prefill-7d9-a")]))  # fmt: skip
    assert changed == {"prefill"}
    assert table.replicas("prefill") == (
        Replica("prefill-7d9-a", "10.0.0.1:7002", "zone-a"),
        Replica("prefill-7d9-b", "10.0.0.2:7002", "zone-a"),
    )
    assert table.replicas("decode") == ()


def test_not_ready_and_terminating_endpoints_take_no_new_work(table: EndpointTable) -> None:
    table.apply("ADDED", endpoint_slice("prefill-abc", "prefill", [
        endpoint("10.0.0.1", "a"),
        endpoint("10.0.0.2", "b", ready=False),  # loading weights, or NOT_SERVING while draining
        endpoint("10.0.0.3", "c", ready=True, terminating=True),  # publishNotReadyAddresses-style
        endpoint("10.0.0.4", "d", ready=None),  # the API: an absent `ready` means ready
    ]))  # fmt: skip
    assert [r.name for r in table.replicas("prefill")] == ["a", "d"]


def test_modified_and_deleted_slices_update_the_replicas_and_report_changes(table: EndpointTable) -> None:
    table.apply("ADDED", endpoint_slice("decode-1", "decode", [endpoint("10.0.1.1", "a"), endpoint("10.0.1.2", "b")]))
    assert table.apply("MODIFIED", endpoint_slice("decode-1", "decode", [endpoint("10.0.1.1", "a"),
                                                                         endpoint("10.0.1.2", "b", ready=False)])) == {
        "decode"
    }  # fmt: skip
    assert [r.name for r in table.replicas("decode")] == ["a"]
    same = endpoint_slice("decode-1", "decode", [endpoint("10.0.1.1", "a")])
    assert table.apply("MODIFIED", same) == set(), "nothing routable changed"
    assert table.apply("DELETED", same) == {"decode"}
    assert table.replicas("decode") == ()
    assert table.apply("BOOKMARK", {"metadata": {"resourceVersion": "7"}}) == set()


def test_a_service_split_over_slices_is_their_union_one_replica_per_address(table: EndpointTable) -> None:
    table.apply("ADDED", endpoint_slice("prefill-1", "prefill", [endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b")]))
    # During a handover the controller may list an endpoint in two slices.
    table.apply("ADDED", endpoint_slice("prefill-2", "prefill", [endpoint("10.0.0.2", "b"), endpoint("10.0.0.3", "c")]))
    assert [r.address for r in table.replicas("prefill")] == ["10.0.0.1:7002", "10.0.0.2:7002", "10.0.0.3:7002"]
    table.apply("DELETED", endpoint_slice("prefill-1", "prefill", []))
    assert [r.name for r in table.replicas("prefill")] == ["b", "c"]


def test_slices_of_other_services_or_without_the_grpc_port_route_nothing(table: EndpointTable) -> None:
    assert table.apply("ADDED", endpoint_slice("cache-1", "cache", [endpoint("10.0.2.1", "cache-0")])) == set()
    no_port = endpoint_slice("prefill-1", "prefill", [endpoint("10.0.0.1", "a")], ports=[{"name": "metrics",
                                                                                         "port": 9102}])  # fmt: skip
    assert table.apply("ADDED", no_port) == set()
    assert table.replicas("prefill") == ()


def test_ipv6_addresses_are_bracketed(table: EndpointTable) -> None:
    table.apply("ADDED", endpoint_slice("prefill-6", "prefill", [endpoint("fd00::5", "a")], addressType="IPv6"))
    assert table.replicas("prefill")[0].address == "[fd00::5]:7002"


def test_a_fresh_listing_forgets_slices_deleted_while_disconnected(table: EndpointTable) -> None:
    table.apply("ADDED", endpoint_slice("prefill-old", "prefill", [endpoint("10.0.0.9", "gone")]))
    changed = table.replace_all([endpoint_slice("prefill-new", "prefill", [endpoint("10.0.0.1", "a")])])
    assert changed == {"prefill"}
    assert [r.name for r in table.replicas("prefill")] == ["a"]


def test_bad_events_are_refused(table: EndpointTable) -> None:
    with pytest.raises(ValueError, match="unexpected watch event type 'ERROR'"):
        table.apply("ERROR", {"code": 410})
    with pytest.raises(ValueError, match="addresses"):
        table.apply("ADDED", endpoint_slice("x", "prefill", [{"conditions": {}}]))


def test_static_discovery_validates_and_sorts_addresses() -> None:
    static = StaticDiscovery(["prefill-1:7002", " prefill-0:7002", "prefill-1:7002"], ["[fd00::1]:7003"])
    assert [r.address for r in static.replicas("prefill")] == ["prefill-0:7002", "prefill-1:7002"]
    assert static.replicas("decode") == (Replica("[fd00::1]:7003", "[fd00::1]:7003"),)
    for bad, message in [("prefill", "is not host:port"), ("prefill:0", "is not host:port"),
                         ("fd00::1:7003", "brackets")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            StaticDiscovery([bad], ["decode:7003"])
    with pytest.raises(ValueError, match="no decode address given"):
        StaticDiscovery(["prefill:7002"], [])


def test_kubernetes_discovery_outside_a_cluster_falls_back_to_static(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    discovery = make_discovery("kubernetes", prefill=["prefill:7002"], decode=["decode:7003"], namespace="v41mesh")
    assert isinstance(discovery, StaticDiscovery)
    assert discovery.replicas("decode") == (Replica("decode:7003", "decode:7003"),)


# --- the list/watch loop through the real client ---


class _ApiStandIn(BaseHTTPRequestHandler):
    """Serves GET .../endpointslices: listings (or a Status with its `code`) from `lists`, watch streams from
    `watches` (one per watch request; a "PAUSE" entry holds the stream until `proceed` is set; once they run out, a
    watch stays open until `release`)."""

    lists: list[dict[str, Any]]
    watches: list[list[dict[str, Any]]]
    requests: list[dict[str, list[str]]]
    release: threading.Event
    proceed: threading.Event

    protocol_version = "HTTP/1.1"  # watches stream as chunked HTTP/1.1, as the API server sends them

    def do_GET(self) -> None:
        query = parse_qs(urlparse(self.path).query)
        type(self).requests.append(query)
        assert urlparse(self.path).path == "/apis/discovery.k8s.io/v1/namespaces/v41mesh/endpointslices"
        assert query["labelSelector"] == ["kubernetes.io/service-name in (decode,prefill)"]
        listing = type(self).lists.pop(0) if query.get("watch") != ["true"] else None
        self.send_response(listing.get("code", 200) if listing else 200)
        self.send_header("Content-Type", "application/json")
        if listing is not None:
            body = json.dumps(listing).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = type(self).watches.pop(0) if type(self).watches else ["HOLD"]
        for event in events:
            if event in ("PAUSE", "HOLD"):
                (type(self).proceed if event == "PAUSE" else type(self).release).wait(10)
                continue
            line = json.dumps(event).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api_stand_in() -> Iterator[type[_ApiStandIn]]:
    handler = type("Handler", (_ApiStandIn,), {"lists": [], "watches": [], "requests": [],
                                               "release": threading.Event(), "proceed": threading.Event()})  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    handler.release.set()
    server.shutdown()
    server.server_close()


def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "discovery did not catch up"
        threading.Event().wait(0.01)


def test_list_then_watch_then_relist_after_410_gone(api_stand_in: type[_ApiStandIn]) -> None:
    slice_a = endpoint_slice("prefill-1", "prefill", [endpoint("10.0.0.1", "a")])
    slice_ab = endpoint_slice("prefill-1", "prefill", [endpoint("10.0.0.1", "a"), endpoint("10.0.0.2", "b")])
    decode = endpoint_slice("decode-1", "decode", [endpoint("10.0.1.1", "d")])
    api_stand_in.lists = [
        {"kind": "EndpointSliceList", "metadata": {"resourceVersion": "100"}, "items": [slice_a]},
        {"kind": "EndpointSliceList", "metadata": {"resourceVersion": "300"}, "items": [decode]},
    ]
    api_stand_in.watches = [[
        {"type": "MODIFIED", "object": slice_ab | {"metadata": slice_ab["metadata"] | {"resourceVersion": "101"}}},
        "PAUSE",
        {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                                     "reason": "Expired", "message": "too old resource version: 101 (250)"}},
    ]]  # fmt: skip
    config = kubernetes.client.Configuration(host=api_stand_in.url)  # type: ignore[attr-defined]
    api = kubernetes.client.DiscoveryV1Api(kubernetes.client.ApiClient(config))
    discovery = KubernetesDiscovery("v41mesh", api=api)
    discovery.start()
    try:
        assert [r.name for r in discovery.replicas("prefill")] == ["a"], "listed before start returns"
        # The watch resumes from the listing's version and its event adds b ...
        _until(lambda: [r.name for r in discovery.replicas("prefill")] == ["a", "b"])
        # ... then 410 Gone forces a fresh list, which is the truth from then on.
        api_stand_in.proceed.set()
        _until(lambda: [r.name for r in discovery.replicas("decode")] == ["d"])
        assert discovery.replicas("prefill") == (), "the fresh list no longer has the prefill slice"
        watches = [q for q in api_stand_in.requests if q.get("watch") == ["true"]]
        assert watches[0]["resourceVersion"] == ["100"]
        _until(lambda: len([q for q in api_stand_in.requests if q.get("watch") == ["true"]]) == 2)
        assert [q for q in api_stand_in.requests if q.get("watch") == ["true"]][1]["resourceVersion"] == ["300"]
    finally:
        discovery.close()


def test_a_forbidden_first_listing_fails_start_with_what_to_grant(api_stand_in: type[_ApiStandIn]) -> None:
    forbidden = (
        'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:v41mesh:default" cannot list '
        'resource "endpointslices"'
    )
    api_stand_in.lists = [{"kind": "Status", "code": 403, "reason": "Forbidden", "message": forbidden}]
    config = kubernetes.client.Configuration(host=api_stand_in.url)  # type: ignore[attr-defined]
    api = kubernetes.client.DiscoveryV1Api(kubernetes.client.ApiClient(config))
    with pytest.raises(DiscoveryError, match=r"cannot list EndpointSlices in namespace 'v41mesh': \(403\)"):
        KubernetesDiscovery("v41mesh", api=api).start()
