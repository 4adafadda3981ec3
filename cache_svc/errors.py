"""The service's failures, each carrying the gRPC status code it is reported with."""

from __future__ import annotations

import grpc


class StatusError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgumentError(StatusError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhaustedError(StatusError):
    """Refused for space: the SSD tier is full of retained blocks, or a DRAM pool or staging is full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFoundError(StatusError):
    code = grpc.StatusCode.NOT_FOUND


class LeaseExpiredError(StatusError):
    """A put stream was not committed within its lease."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class StorageError(StatusError):
    """The SSD tier could not write: this replica should not be used until an operator looks."""

    code = grpc.StatusCode.UNAVAILABLE
