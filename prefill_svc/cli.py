"""`python -m prefill_svc serve` and `python -m decode_svc serve`: one entry point for the model services.

Public: decode_svc's __main__ uses it. It imports no torch: the configuration is parsed, validated and logged first,
so a bad flag exits 2 at once naming the setting; the server (torch, the model) is imported only after that.
"""

from __future__ import annotations

import asyncio
import importlib
import sys

from mesh.config import config_dict, load_config
from mesh.grpc_server import run_until_signal
from mesh.logging import configure_logging
from prefill_svc.config import ModelServiceConfig


def serve_main(
    argv: list[str] | None, *, package: str, config: type[ModelServiceConfig], env_prefix: str, server: str
) -> int:
    """Run `server` ("module:Class", built from the config) until SIGTERM/SIGINT. Exit 0 after a clean stop, 1 when
    it cannot start (a port in use, an unknown model, a bad checkpoint), 2 for bad usage or configuration."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print(f"usage: python -m {package} serve [options]  (serve --help lists them)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cfg = load_config(config, argv[1:], env_prefix=env_prefix, prog=f"python -m {package} serve")
    logger = configure_logging(package, level=cfg.log_level)
    logger.info("config", **config_dict(cfg))
    module, name = server.split(":")
    server_class = getattr(importlib.import_module(module), name)
    try:
        asyncio.run(run_until_signal(server_class(cfg), grace_s=cfg.grace_s))
    except (OSError, ValueError) as exc:
        logger.error("cannot_start", error=str(exc))
        return 1
    return 0
