"""`python -m prefill_svc serve --cache ADDR[,ADDR...] [--model tiny|small|CHECKPOINT_DIR] [...]`: one prefill replica.

Every flag is also a PREFILL_SVC_* environment variable (`--max-queue` ↔ PREFILL_SVC_MAX_QUEUE); the resolved
configuration is logged at start, then `model_loaded` and `serving` (the bound port: `--port 0` picks a free one).
SIGTERM or SIGINT: health NOT_SERVING, in-flight prefills get --grace-s seconds, exit status 0.
"""

from __future__ import annotations

from mesh.grpc_server import Servable, serve_main
from prefill_svc.config import ENV_PREFIX, PrefillConfig


def _server(cfg: PrefillConfig) -> Servable:
    # Imported only once the flags are valid: a bad flag exits 2 at once, without loading torch.
    from prefill_svc.server import PrefillServer

    return PrefillServer(cfg)


def main(argv: list[str] | None = None) -> int:
    return serve_main(argv, service="prefill_svc", config=PrefillConfig, env_prefix=ENV_PREFIX, make_server=_server)


if __name__ == "__main__":
    raise SystemExit(main())
