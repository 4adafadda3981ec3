"""Structured logs (structlog) for every service: JSON lines by default, one `request_id` across
services through context variables bound per RPC."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(service: str, *, level: str = "info", json: bool = True) -> structlog.stdlib.BoundLogger:
    """Configure structlog once per process and return the service's logger."""
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write per line: with write-through stderr (PYTHONUNBUFFERED, as `mesh up` runs its children) print's
        # two writes, the line then its newline, interleave with another process's on a shared pipe (a rank group)
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger(service=service)


def get_logger(service: str) -> Any:
    return structlog.get_logger(service=service)


bind_request = structlog.contextvars.bound_contextvars
"""`with bind_request(request_id=...):` tags every log line inside with the request id."""
