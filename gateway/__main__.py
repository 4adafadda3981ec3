"""`python -m gateway serve --prefill ADDRS --decode ADDRS --cache ADDRS [...]`: run the gateway.

Every flag is also a GATEWAY_* environment variable (`--api-key` ↔ GATEWAY_API_KEY); the resolved configuration
is logged at start (the key masked). SIGTERM or SIGINT drains: /health turns 503, in-flight responses get
`--grace-s` seconds, exit status 0.
"""

from __future__ import annotations

import asyncio
import sys

from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.server import GatewayServer
from mesh.config import config_dict, load_config
from mesh.grpc_server import run_until_signal
from mesh.logging import configure_logging

USAGE = "usage: python -m gateway serve --prefill ADDRS --decode ADDRS [--cache ADDRS] [options]  (serve --help)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cfg = load_config(GatewayConfig, argv[1:], env_prefix=ENV_PREFIX, prog="python -m gateway serve")
    logger = configure_logging("gateway", level=cfg.log_level)
    logger.info("config", **config_dict(cfg))
    try:
        server = GatewayServer(cfg)
        asyncio.run(run_until_signal(server, grace_s=cfg.grace_s))
    except (OSError, ValueError) as exc:
        logger.error("cannot_start", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
