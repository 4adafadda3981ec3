"""A batch of decode Generate streams run from a process of its own, so that the client's Python (a thread per stream
receiving and decoding every message) does not take the GIL from the decode engine it measures, as the gateway,
another process, does not.

    client = StreamClient()             # a spawned process, kept for every batch
    result = client.run(port, batch)    # every stream's first-token time, message times and tokens
    client.close()

Times are `time.perf_counter()` readings of the child: the system's monotonic clock, which the parent's readings
share.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

STREAM_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Batch:
    """Streams to run at once: stream i decodes prompts[i] (`seeds[i]`: its sampling seed, None for none)."""

    prompts: list[list[int]]
    temperature: float
    seeds: list[int | None]
    max_tokens: int


@dataclass(frozen=True)
class Streams:
    """What the streams received: per stream, the time of its first token, (time, tokens) per message, its tokens."""

    first: list[float]
    stamps: list[list[tuple[float, int]]]
    outputs: list[list[int]]


class StreamClient:
    def __init__(self) -> None:
        context = mp.get_context("spawn")  # a fresh interpreter: no torch, no CUDA, no server threads in it
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_serve, args=(child,), name="stream-client", daemon=True)
        self._proc.start()
        child.close()

    def run(self, port: int, batch: Batch) -> Streams:
        """Run `batch` against the decode server on 127.0.0.1:`port`."""
        self._conn.send((port, batch))
        reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=30)


def _serve(conn: Connection) -> None:
    while (job := conn.recv()) is not None:
        port, batch = job
        try:
            conn.send(_streams(port, batch))
        except Exception as exc:  # the parent raises it
            conn.send(exc)


def _streams(port: int, batch: Batch) -> Streams:
    import grpc

    from proto.decode.v1 import decode_pb2, decode_pb2_grpc

    n = len(batch.prompts)
    first, outputs = [0.0] * n, [[] for _ in range(n)]
    stamps: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def stream(i: int, stub: Any) -> None:
        params = decode_pb2.SamplingParams(temperature=batch.temperature)
        if batch.seeds[i] is not None:
            params.seed = batch.seeds[i]
        request = decode_pb2.GenerateRequest(
            token_ids=decode_pb2.TokenIds(ids=batch.prompts[i]), max_tokens=batch.max_tokens, sampling=params
        )
        try:
            for message in stub.Generate(request, timeout=STREAM_TIMEOUT_S):
                now = time.perf_counter()
                if message.token_ids and not outputs[i]:
                    first[i] = now
                outputs[i] += message.token_ids
                stamps[i].append((now, len(message.token_ids)))
        except grpc.RpcError as exc:
            errors.append(exc)

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        threads = [threading.Thread(target=stream, args=(i, stub)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed: {errors[0]}")
    return Streams(first, stamps, outputs)
