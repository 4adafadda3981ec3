"""What a model-serving process needs around the model: loading it from a `--model` spec, checking a prompt, refusing
a request with a precise status, and the server life cycle.

Both model services use it: they load a part of the same model, validate prompts the same way and start and stop
alike. A model spec is a preset name (`tiny`, `small`: weights initialised deterministically from
`seed`) or a checkpoint directory (config.json + safetensors shards).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

from cache_svc.client import AsyncCacheClient
from mesh.grpc_server import GrpcServer, Registrar
from mesh.logging import get_logger
from mesh.metrics import new_registry, serve_metrics
from model import (
    LAYOUT_VERSION,
    DecodeBatch,
    SamplingParams,
    Transformer,
    build_model,
    encode_prefill,
    kernels,
    load_checkpoint,
    preset,
)
from model.checkpoint import Checkpoint
from model.engram_store import Placement, choose_placement, table_bytes
from model.parallel import SINGLE, Parallel
from model.shared_tables import SharedTables
from model.transformer import Part
from model.weights import weight_bytes
from model_service.config import ModelServiceConfig
from model_service.errors import RequestError
from model_service.ranks import LocalCalls, ModelCalls, RankGroup, RankGroupError, follower_main, start_group
from proto.mesh.v1 import model_info_pb2

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` = the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` = bfloat16 on a GPU, float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(
    spec: str,
    part: Part,
    *,
    device: str = "auto",
    dtype: str = "auto",
    seed: int = 0,
    engram: str = "auto",
    parallel: Parallel = SINGLE,
    shared: SharedTables | None = None,
) -> Transformer:
    """The model part named by `spec` (a preset, a config.json, or a checkpoint directory), in eval mode and frozen
    (no parameter asks for a gradient: a forward outside `no_grad` still takes the kernels, never their autograd
    form); its Engram tables placed by `engram` (`engram_placement`; `host` with `shared`: in the node's table file,
    filled by its owner, which the other ranks wait for here); of the routed experts, `parallel`'s share."""
    where = resolve_device(device)
    precision = resolve_dtype(dtype, where)
    progress = sys.stderr.isatty()  # a bar on a terminal; JSON log lines stay clean in a container
    placement = engram_placement(spec, device, dtype, engram)
    share = {"engram": placement, "parallel": parallel, "shared": shared}
    if Path(spec).is_dir():
        model = load_checkpoint(spec, part, device=where, dtype=precision, progress=progress, **share)
    else:
        model = build_model(preset(spec), part, seed=seed, device=where, dtype=precision, **share)
    if shared is not None and placement == "host":
        shared.filled()
    model.engram_placement = placement
    return model.eval().requires_grad_(False)


def engram_placement(spec: str, device: str, dtype: str, engram: str) -> Placement:
    """Where `--engram-store engram` puts the tables of the model `spec` on `device` (`auto`: by their size and the
    host's free memory, `model.engram_store.choose_placement`)."""
    where = resolve_device(device)
    checkpoint = Path(spec).is_dir()
    args = Checkpoint(spec).args if checkpoint else preset(spec)
    return choose_placement(engram, table_bytes(args, resolve_dtype(dtype, where)), where, checkpoint)


def load_service_model(
    cfg: ModelServiceConfig,
    part: Part,
    device: str,
    parallel: Parallel = SINGLE,
    shared: SharedTables | None = None,
) -> Transformer:
    """A service's model (or its rank's share), warmed up, after the process-wide settings that must come before the
    first forward: CPU threads and, on a GPU, batch invariance (`model.kernels.invariance`)."""
    if threads := cpu_threads(cfg, device):
        torch.set_num_threads(threads)
    if cfg.batch_invariant and resolve_device(device).type == "cuda":
        kernels.set_batch_invariant(True)
    model = load_model(
        cfg.model, part, device=device, dtype=cfg.dtype, seed=cfg.seed, engram=cfg.engram_store, parallel=parallel,
        shared=shared,
    )  # fmt: skip
    warm_up(model)
    return model


def cpu_threads(cfg: ModelServiceConfig, device: str) -> int:
    """torch CPU threads of one process: --threads, or on the CPU a rank's share of this node's cores (W ranks each
    taking every core would oversubscribe them W times over); 0 keeps torch's default."""
    if cfg.threads or cfg.ranks == 1 or resolve_device(device).type != "cpu":
        return cfg.threads
    return max(1, len(os.sched_getaffinity(0)) // cfg.ranks)


def warm_up(model: Transformer) -> None:
    """One tiny pass through every path a request takes, before the replica reports SERVING: first calls build lazy
    state (the Engram hash tables, kernel and allocator caches), and the first user should not pay for it."""
    out = encode_prefill(model, [0])
    if model.part != "full":
        return
    batch = DecodeBatch(model)
    batch.join(out.blocks, out.encoder_state)
    greedy = SamplingParams.uniform(1)
    batch.verify([0], batch.dspark_draft([0], greedy), greedy)
    batch.decode_step([0])


def prompt_error(token_ids: Sequence[int], model: Transformer, *, room: int = 1) -> str | None:
    """Why a prompt cannot be served (None if it can): empty, an id outside the vocabulary, or too long to leave
    `room` positions for the output inside the model's context."""
    if not token_ids:
        return "token_ids is empty"
    vocab = model.args.vocab_size
    for i, token in enumerate(token_ids):
        if token >= vocab:
            return f"token_ids[{i}] = {token} is outside the vocabulary [0, {vocab})"
    limit = max_context(model) - room
    if len(token_ids) > limit:
        return f"the prompt has {len(token_ids)} tokens; at most {limit} fit the model's context of {limit + room}"
    return None


def max_context(model: Transformer) -> int:
    return model.args.max_position_embeddings


def model_info(model: Transformer, spec: str) -> model_info_pb2.ModelInfo:
    """What GetModelInfo answers on every replica (prefill and decode alike): the model's name (the last part of
    its `--model` spec), fingerprint, and what callers need to compute block keys and validate requests."""
    a = model.args
    return model_info_pb2.ModelInfo(
        model=Path(spec).name,
        fingerprint=model.fingerprint,
        kv_block_tokens=a.kv_block_tokens,
        layout_version=LAYOUT_VERSION,
        vocab_size=a.vocab_size,
        max_context=max_context(model),
        sliding_window=a.sliding_window,
    )


# ------------------------------------------------------------------------------------------------------ requests
MAX_REQUEST_ID_CHARS = 256
MAX_SALT_BYTES = 1024


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, "invalid")


def request_id_of(field: str, context: grpc.aio.ServicerContext) -> str:
    """The request id of an RPC: the message field, else the `x-request-id` metadata, else a fresh one."""
    if field:
        return field
    metadata = dict(context.invocation_metadata() or ())
    return str(metadata.get("x-request-id") or uuid.uuid4().hex)


def check_common(request_id: str, salt: bytes) -> None:
    """The fields every mesh request carries."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")
    if len(salt) > MAX_SALT_BYTES:
        raise invalid(f"cache_salt has {len(salt)} bytes; at most {MAX_SALT_BYTES} are allowed")


def model_summary(model: Transformer) -> dict[str, object]:
    """What the start-up log says about the loaded model: its resident weight bytes beside the checkpoint bytes it
    read (equal at the released dtype: quantised weights stay packed), and how fast they loaded."""
    loaded = getattr(model, "load_report", None)
    read = {} if loaded is None else {
        "checkpoint_bytes": loaded.read_bytes, "load_seconds": round(loaded.seconds, 3),
        "load_gb_per_s": round(loaded.gb_per_s, 2),
    }  # fmt: skip
    return {
        "part": model.part,
        "fingerprint": model.fingerprint.hex(),
        "weight_bytes": weight_bytes(model),
        "device_weight_bytes": weight_bytes(model, model.device),
        "engram_store": getattr(model, "engram_placement", "device"),
        **read,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_block_tokens": model.args.kv_block_tokens,
        "max_context": max_context(model),
    }


# -------------------------------------------------------------------------------------------------------- servers
class ModelServer:
    """The life cycle every model service shares (prefill_svc.server, decode_svc.server).

    `start()` loads and warms the model (unless one is given) before the gRPC server starts, so health turns
    SERVING only when the replica is ready; `build()` (the service's own) makes the servicer and `ready()` waits
    for the service's own start-up work. `stop()` is graceful: the servicer reports draining, health turns
    NOT_SERVING, in-flight RPCs get the grace period, then `release()` (the service's own) frees what the service
    holds, and the cache client closes.

    With `--ranks`/`--nodes` making W > 1 the replica is a rank group (model_service.ranks): on node 0 this process
    is rank 0 and makes its model calls through `self.calls` (every rank runs them); on another node it only follows
    rank 0's plans, serving its metrics port. When the group fails, `fail_all()` (the service's own) ends the work in
    flight with UNAVAILABLE, `failed` is set and the process exits with `exit_status` 1.
    """

    package: str  # the service's package: its logger's name
    part: Part  # the part of the model it serves
    service: str  # its full gRPC service name (health, reflection)

    def __init__(self, cfg: ModelServiceConfig, *, model: Transformer | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.log: Any = get_logger(self.package)
        self.registry = new_registry()
        self.port = 0
        self.metrics_port = 0
        self.cache: AsyncCacheClient | None = None
        self.servicer: Any = None
        self._grpc: GrpcServer | None = None
        self.group: RankGroup | None = None
        self.calls: ModelCalls = LocalCalls(model) if model is not None else ModelCalls()
        self.failed = asyncio.Event()
        self.exit_status = 0

    def fail_all(self, error: RequestError) -> None:
        """End every request in flight with `error` (the rank group failed; the process exits next)."""

    def build(self) -> tuple[Any, Registrar]:
        """The servicer and the function that adds it to a grpc server (called with model and cache client ready)."""
        raise NotImplementedError

    async def release(self) -> None:
        """Free what the service holds, after the last RPC ended."""

    async def ready(self) -> None:
        """Wait for the service's own start-up work (called after `build()`, before health turns SERVING)."""

    async def start(self) -> None:
        cfg = self.cfg
        if cfg.world_size > 1:
            await self._start_group()
            if cfg.node_rank > 0:
                return
        if self.model is None:
            self.model = await asyncio.to_thread(self._load)
            self.calls = LocalCalls(self.model)
        self.cache = AsyncCacheClient(cfg.cache, timeout_s=cfg.cache_timeout_s) if cfg.cache else None
        self.servicer, register = self.build()
        await self.ready()
        self._grpc = GrpcServer([(register, self.servicer, self.service)], cfg.host, cfg.port)
        self.port = self._grpc.port
        await self._grpc.start()
        self.metrics_port = serve_metrics(self.registry, cfg.metrics_host, cfg.metrics_port)
        self.log.info("serving", host=cfg.host, port=self.port, metrics_port=self.metrics_port)

    async def stop(self, grace_s: float | None = None) -> None:
        if self.servicer is not None:
            self.servicer.draining = True
        if self._grpc is not None:
            await self._grpc.stop(self.cfg.grace_s if grace_s is None else grace_s)
        await self.release()
        if self.cache is not None:
            await self.cache.close()
        if self.group is not None and self.cfg.node_rank == 0:
            await asyncio.to_thread(self.group.close)
        self.log.info("stopped")

    async def _start_group(self) -> None:
        """Spawn and meet this node's ranks and load this rank's share; node rank > 0 then follows plans."""
        loop = asyncio.get_running_loop()
        self.group, model = await asyncio.to_thread(start_group, self.cfg, self.part, self.log)
        self.group.on_failure.append(lambda reason: loop.call_soon_threadsafe(self._group_failed, reason))
        self.log.info("model_loaded", rank=self.group.layout.rank, **model_summary(model))
        if self.cfg.node_rank == 0:
            self.model, self.calls = model, self.group.calls(model)
            return
        self.metrics_port = serve_metrics(self.registry, self.cfg.metrics_host, self.cfg.metrics_port)
        follower = asyncio.to_thread(follower_main, self.group, model)
        asyncio.ensure_future(follower).add_done_callback(lambda done: self._followed(done.result()))

    def _followed(self, status: int) -> None:
        """A follower node's plans ended: rank 0 stopped the group (0) or the group failed (1)."""
        self.exit_status = status
        self.failed.set()

    def _group_failed(self, reason: str) -> None:
        """On the event loop: the rank group failed; end what is in flight and make the process exit non-zero."""
        if self.servicer is not None:
            self.servicer.draining = True
        self.fail_all(RankGroupError(reason))
        self.exit_status = 1
        self.failed.set()

    def _load(self) -> Transformer:
        started = time.monotonic()
        model = load_service_model(self.cfg, self.part, self.cfg.device)
        self.log.info("model_loaded", seconds=round(time.monotonic() - started, 3), **model_summary(model))
        return model
