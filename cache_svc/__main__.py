"""`python -m cache_svc serve --host H --port P --data-dir DIR [...]`: run one cache replica.

Every flag is also a CACHE_SVC_* environment variable (`--ssd-bytes` ↔ CACHE_SVC_SSD_BYTES); the resolved
configuration is logged at start. SIGTERM or SIGINT stops it gracefully: no new RPCs, in-flight commits
finish and are fsynced, exit status 0.
"""

from __future__ import annotations

from cache_svc.config import ENV_PREFIX, CacheConfig, resolve_defaults
from cache_svc.server import CacheServer
from mesh.grpc_server import serve_main


def main(argv: list[str] | None = None) -> int:
    return serve_main(
        argv,
        service="cache_svc",
        config=CacheConfig,
        env_prefix=ENV_PREFIX,
        make_server=CacheServer,
        resolve=resolve_defaults,
    )


if __name__ == "__main__":
    raise SystemExit(main())
