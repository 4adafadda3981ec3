"""The error a model service answers a request it will not serve with (runtime.py re-exports it)."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request the service will not serve: the gRPC status, a message naming what is wrong, a metrics label."""

    def __init__(self, code: grpc.StatusCode, message: str, outcome: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.outcome = outcome
