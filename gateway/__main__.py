"""`python -m gateway serve --prefill ADDRS --decode ADDRS --cache ADDRS [...]`: run the gateway.

Every flag is also a GATEWAY_* environment variable (`--api-key` ↔ GATEWAY_API_KEY); the resolved configuration
is logged at start (the key masked). SIGTERM or SIGINT drains: /health turns 503, in-flight responses get
`--grace-s` seconds, exit status 0.
"""

from __future__ import annotations

from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.server import GatewayServer
from mesh.grpc_server import serve_main


def main(argv: list[str] | None = None) -> int:
    return serve_main(argv, service="gateway", config=GatewayConfig, env_prefix=ENV_PREFIX, make_server=GatewayServer)


if __name__ == "__main__":
    raise SystemExit(main())
