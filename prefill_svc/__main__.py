"""`python -m prefill_svc serve --cache ADDR[,ADDR...] [--model tiny|small|CHECKPOINT_DIR] [...]`: one prefill replica.

Every flag is also a PREFILL_SVC_* environment variable (`--max-queue` ↔ PREFILL_SVC_MAX_QUEUE); the resolved
configuration is logged at start, then `model_loaded` and `serving` (the bound port: `--port 0` picks a free one).
SIGTERM or SIGINT: health NOT_SERVING, in-flight prefills get --grace-s seconds, exit status 0.
"""

from __future__ import annotations

from prefill_svc.cli import serve_main
from prefill_svc.config import ENV_PREFIX, PrefillConfig


def main(argv: list[str] | None = None) -> int:
    return serve_main(
        argv,
        package="prefill_svc",
        config=PrefillConfig,
        env_prefix=ENV_PREFIX,
        server="prefill_svc.server:PrefillServer",
    )


if __name__ == "__main__":
    raise SystemExit(main())
