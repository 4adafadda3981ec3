"""`python -m decode_svc serve [--cache ADDR[,ADDR...]] [--model tiny|small|CHECKPOINT_DIR] [...]`: one decode replica.

Every flag is also a DECODE_SVC_* environment variable (`--max-batch` ↔ DECODE_SVC_MAX_BATCH,
`--no-speculation` ↔ DECODE_SVC_SPECULATION=false); the resolved configuration is logged at start, then
`model_loaded` and `serving` (the bound port: `--port 0` picks a free one). SIGTERM or SIGINT: health NOT_SERVING,
running generations get --grace-s seconds, exit status 0.
"""

from __future__ import annotations

from decode_svc.config import ENV_PREFIX, DecodeConfig
from mesh.grpc_server import Servable, serve_main


def _server(cfg: DecodeConfig) -> Servable:
    # Imported only once the flags are valid: a bad flag exits 2 at once, without loading torch.
    from decode_svc.server import DecodeServer

    return DecodeServer(cfg)


def main(argv: list[str] | None = None) -> int:
    return serve_main(argv, service="decode_svc", config=DecodeConfig, env_prefix=ENV_PREFIX, make_server=_server)


if __name__ == "__main__":
    raise SystemExit(main())
