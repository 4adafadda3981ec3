"""`python -m decode_svc serve [--cache ADDR[,ADDR...]] [--model tiny|small|CHECKPOINT_DIR] [...]`: one decode replica.

Every flag is also a DECODE_SVC_* environment variable (`--max-batch` ↔ DECODE_SVC_MAX_BATCH,
`--no-speculation` ↔ DECODE_SVC_SPECULATION=false); the resolved configuration is logged at start, then
`model_loaded` and `serving` (the bound port: `--port 0` picks a free one). SIGTERM or SIGINT: health NOT_SERVING,
running generations get --grace-s seconds, exit status 0.
"""

from __future__ import annotations

from decode_svc.config import ENV_PREFIX, DecodeConfig
from prefill_svc.cli import serve_main


def main(argv: list[str] | None = None) -> int:
    return serve_main(
        argv, package="decode_svc", config=DecodeConfig, env_prefix=ENV_PREFIX, server="decode_svc.server:DecodeServer"
    )


if __name__ == "__main__":
    raise SystemExit(main())
