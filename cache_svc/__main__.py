"""`python -m cache_svc serve --host H --port P --data-dir DIR [...]`: run one cache replica.

Every flag is also a CACHE_SVC_* environment variable (`--ssd-bytes` ↔ CACHE_SVC_SSD_BYTES); the resolved
configuration is logged at start. SIGTERM or SIGINT stops it gracefully: no new RPCs, in-flight commits
finish and are fsynced, exit status 0.
"""

from __future__ import annotations

import asyncio
import sys

from cache_svc.config import ENV_PREFIX, CacheConfig, resolve_defaults
from cache_svc.segment_log import DataDirInUseError
from cache_svc.server import CacheServer
from mesh.config import config_dict, load_config
from mesh.grpc_server import run_until_signal
from mesh.logging import configure_logging

USAGE = "usage: python -m cache_svc serve --data-dir DIR [--host H] [--port P] [options]  (serve --help for all)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cfg = resolve_defaults(load_config(CacheConfig, argv[1:], env_prefix=ENV_PREFIX, prog="python -m cache_svc serve"))
    logger = configure_logging("cache_svc", level=cfg.log_level)
    logger.info("config", **config_dict(cfg))
    server = CacheServer(cfg)
    try:
        asyncio.run(run_until_signal(server, grace_s=cfg.grace_s))
    except (DataDirInUseError, OSError) as exc:
        logger.error("cannot_start", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
