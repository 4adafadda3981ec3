"""`python -m decode_svc serve [--cache ADDR[,ADDR...]] [--model tiny|small|CHECKPOINT_DIR] [...]`: one decode replica.

Every flag is also a DECODE_SVC_* environment variable (`--max-batch` ↔ DECODE_SVC_MAX_BATCH,
`--no-speculation` ↔ DECODE_SVC_SPECULATION=false); the resolved configuration is logged at start, then
`model_loaded` and `serving` (the bound port: `--port 0` picks a free one). SIGTERM or SIGINT: health NOT_SERVING,
running generations get --grace-s seconds, exit status 0.
"""

from __future__ import annotations

import asyncio
import sys

from decode_svc.config import ENV_PREFIX, DecodeConfig
from mesh.config import config_dict, load_config
from mesh.grpc_server import run_until_signal
from mesh.logging import configure_logging

USAGE = "usage: python -m decode_svc serve [--cache ADDR[,ADDR...]] [--model M] [--port P] [options]  (serve --help)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cfg = load_config(DecodeConfig, argv[1:], env_prefix=ENV_PREFIX, prog="python -m decode_svc serve")
    logger = configure_logging("decode_svc", level=cfg.log_level)
    logger.info("config", **config_dict(cfg))
    # torch and the model load only now: a bad flag is reported at once, not after seconds of imports.
    import torch

    from decode_svc.server import DecodeServer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        asyncio.run(run_until_signal(DecodeServer(cfg), grace_s=cfg.grace_s))
    except (OSError, ValueError) as exc:  # a port in use, an unknown model or a bad checkpoint
        logger.error("cannot_start", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
