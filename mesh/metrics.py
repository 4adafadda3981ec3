"""Prometheus metrics: one registry per service instance (several services may share a process in
tests), served on the service's metrics port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

# Latency buckets (seconds) shared by the services: 1 ms … 60 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Expose `registry` over HTTP at http://host:port/metrics; port 0 disables it. Returns the port."""
    if port <= 0:
        return 0
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
