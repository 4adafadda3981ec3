"""`python -m mesh up`: the whole mesh on this machine (cache, prefill, decode, gateway as separate processes on
loopback), healthy before the base URL is printed, stopped cleanly on Ctrl-C / SIGTERM.

A child that dies is restarted after a backoff, at most `--max-restarts` times within any `--restart-window-s`
seconds (mesh/restarts.py); one more death inside the window stops the whole mesh and the command exits 1, showing
the child's last log lines.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from mesh.config import config_dict, load_config
from mesh.processes import Mesh, MeshError, MeshSpec
from mesh.restarts import RestartBudget, RestartPolicy

# The model `make up` serves: the embedded trained demo checkpoint (train/, docs/training.md).
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "model" / "checkpoints" / "v41-demo")
DEFAULT_DATA_DIR = "~/.cache/v41mesh"
ENV_PREFIX = "MESH"
WATCH_INTERVAL_S = 0.5

Count = Annotated[int, msgspec.Meta(ge=1, le=64)]


class UpConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Run the mesh locally: cache, prefill, decode and gateway on loopback.

    model: tiny, small, or a checkpoint directory (prefill and decode load it)
    engram_store: where prefill and decode keep the Engram tables: auto, device, host or mmap (their --engram-store)
    port: the gateway's HTTP port (0 picks a free one)
    data_dir: the cache's SSD tier, logs and mesh.json live here (kept between runs: prefixes stay cached)
    prefill_replicas: prefill processes
    decode_replicas: decode processes
    gateway_replicas: gateway processes in front of the same replicas (the first on --port, the others on free ports)
    prefill_ranks: rank processes of each prefill replica (its --ranks: a group splitting the encoder's experts)
    decode_ranks: rank processes of each decode replica (its --ranks: a group splitting the model's experts)
    api_key: require this key from API clients
    cache_args: extra flags for the cache, as one shell-quoted string
    prefill_args: extra flags for every prefill replica
    decode_args: extra flags for every decode replica (e.g. "--no-speculation")
    gateway_args: extra flags for the gateway
    startup_timeout_s: how long the processes may take to become healthy
    max_restarts: restarts of one child allowed within restart_window_s; one more death stops the mesh
    restart_window_s: the window max_restarts counts restarts in
    restart_backoff_s: wait before restarting a child, doubled for each of its restarts within the window
    """

    model: str = DEFAULT_MODEL
    engram_store: Literal["auto", "device", "host", "mmap"] = "auto"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    data_dir: str = DEFAULT_DATA_DIR
    prefill_replicas: Count = 1
    decode_replicas: Count = 1
    gateway_replicas: Count = 1
    prefill_ranks: Count = 1
    decode_ranks: Count = 1
    api_key: str = ""
    cache_args: str = ""
    prefill_args: str = ""
    decode_args: str = ""
    gateway_args: str = ""
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 5
    restart_window_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    restart_backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0


def spec_of(cfg: UpConfig) -> MeshSpec:
    return MeshSpec(
        model=cfg.model,
        data_dir=Path(cfg.data_dir).expanduser(),
        port=cfg.port,
        prefill_replicas=cfg.prefill_replicas,
        decode_replicas=cfg.decode_replicas,
        gateway_replicas=cfg.gateway_replicas,
        prefill_ranks=cfg.prefill_ranks,
        decode_ranks=cfg.decode_ranks,
        api_key=cfg.api_key,
        cache_args=shlex.split(cfg.cache_args),
        prefill_args=["--engram-store", cfg.engram_store, *shlex.split(cfg.prefill_args)],
        decode_args=["--engram-store", cfg.engram_store, *shlex.split(cfg.decode_args)],
        gateway_args=shlex.split(cfg.gateway_args),
    )


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def restart_policy(cfg: UpConfig) -> RestartPolicy:
    return RestartPolicy(max_restarts=cfg.max_restarts, window_s=cfg.restart_window_s, backoff_s=cfg.restart_backoff_s)


def watch(
    mesh: Mesh,
    stop: threading.Event,
    policy: RestartPolicy,
    interval_s: float = WATCH_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Restart children that die, within `policy`, until `stop` is set; 1 when one died too often."""
    budgets = {child.name: RestartBudget(policy) for child in mesh.children}
    due: dict[str, float] = {}  # dead children → when they restart
    while not stop.wait(interval_s):
        for child in mesh.dead():
            budget, now = budgets[child.name], clock()
            if child.name not in due:
                code = child.process.returncode if child.process else None
                if not budget.allows(now):
                    say(
                        f"{child.name} exited with status {code} after {budget.recent(now)} restarts within "
                        f"{policy.window_s:g} s; stopping the mesh"
                    )
                    say(child.tail())
                    return 1
                due[child.name] = now + budget.delay(now)
                say(
                    f"{child.name} exited with status {code}; restarting it in {budget.delay(now):.1f} s "
                    f"({budget.recent(now) + 1} of {policy.max_restarts} within {policy.window_s:g} s, "
                    f"{budget.total + 1} in all)"
                )
            if now >= due[child.name]:
                del due[child.name]
                budget.record(now)
                try:
                    mesh.restart(child.name)
                except MeshError as exc:
                    say(str(exc))
                    return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(UpConfig, argv, env_prefix=ENV_PREFIX, prog="python -m mesh up")
    say(f"v41mesh up: {config_dict(cfg)}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mesh = Mesh(spec_of(cfg), on_event=lambda line: say("  " + line))
    say(f"starting {', '.join(c.name for c in mesh.children)} (model {cfg.model}; logs in {mesh.logs})")
    try:
        mesh.start(cfg.startup_timeout_s, cancelled=stop.is_set)
    except MeshError as exc:
        say(f"the mesh could not start: {exc}")
        return 1
    say("")
    for url, grpc_address in zip(mesh.base_urls, mesh.grpc_addresses, strict=True):
        say(f"v41mesh is up: {url}/v1   (gRPC gateway.v1.Gateway at {grpc_address})")
    say(f"  try: python -m mesh demo --base-url {mesh.base_url}\n  Ctrl-C stops it.")
    print(mesh.base_url, flush=True)
    status = watch(mesh, stop, restart_policy(cfg))
    say("stopping the mesh ...")
    codes = mesh.stop()
    say("stopped: " + ", ".join(f"{name} {'killed' if code is None else code}" for name, code in codes.items()))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
