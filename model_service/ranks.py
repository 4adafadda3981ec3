"""A model-service replica as a rank group: W = ranks·nodes processes over torch.distributed, routed experts split
over them (`model.parallel`), every rank running its part of each model call rank 0 makes.

    node 0, service process = global rank 0   gRPC, scheduler/engine; every model call it makes is a *plan*
      ├─ local ranks 1..ranks-1               spawned here (`python -m model_service.ranks`, torchrun's environment)
    node k > 0, service process = rank k·ranks   follows plans; spawns its own local ranks likewise

Rank 0 drives the group by broadcasting each call it makes on the model as a pickled *plan* over a gloo group
(`broadcast_object_list`); the followers execute it, in the same order, so their MoE collectives meet rank 0's; then
every rank reports how its part went (`gather_object`: an `Outcome`). The engine makes its calls through a
`ModelCalls` (`LocalCalls` at W = 1: the single-process path; `GroupCalls` at W > 1). A plan is one of:

    new / call / run   the same call on every rank's replica (replicated: a local prefill's chunk, a whole
                       `encode_with_past`, the step-time profile); a follower that fails where rank 0 did not has
                       drifted from it, and fails the group
    spread             each rank its own arguments and its own result (data-parallel attention: every rank decodes
                       its own sequences, decode_svc.spread); rank 0 gets every rank's `Outcome`, failures included

Failure: every follower bumps a heartbeat counter in the group's store each `rank_timeout_s / 5`; rank 0's watcher
polls its local children (dead → failed at once) and the counters (one unchanged for `rank_timeout_s` → failed). A
rank whose process lives but whose plan hangs (its heartbeat beats on) stops the whole group within the plan: every
rank enters every MoE round and reports on every plan, so while a plan is in flight rank 0's own progress — rounds
entered, plan parts done — stands still from the moment any rank hangs; still for `stall_timeout_s` → failed, naming
the ranks behind the others (each follower posts its progress with its heartbeat).
A failed group kills its local children (which also ends any collective rank 0 waits in), makes every later call
raise `RankGroupError` (UNAVAILABLE), and tells the service (`on_failure`): health NOT_SERVING, streams end with
UNAVAILABLE, the process exits non-zero for its supervisor to restart the group. A follower exits as soon as rank
0's store or its parent is gone, or a collective fails: no rank is left running.

Host Engram tables (`--engram-store host`) exist once a node: its service process resolves the placement before it
spawns the local ranks and hands them the node's table file, which it fills and they map (`model.shared_tables`).

Plans are pickles between the processes of one group (trusted peers on a private network, like NCCL's own traffic).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import msgspec
import torch
import torch.distributed as dist

from model import Transformer, preset
from model.checkpoint import Checkpoint
from model.parallel import Parallel, Rounds
from model.shared_tables import FD_ENV, SharedTables
from model.transformer import Part
from model_service.config import ModelServiceConfig
from model_service.errors import RequestError

CONFIG_ENV = "V41MESH_RANK_CONFIG"  # the replica's configuration (JSON) handed to the rank processes it spawns
PART_ENV = "V41MESH_RANK_PART"
WATCH_INTERVAL_S = 0.2
STOP_WAIT_S = 10.0


class RankGroupError(RequestError):
    """The rank group lost a rank (dead, silent, or a collective failed): nothing more can run on it."""

    def __init__(self, reason: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"the replica's rank group failed: {reason}", "rank_failed")


# ------------------------------------------------------------------------------------------------ the layout
@dataclass(frozen=True)
class Layout:
    """Where this process sits in its group (torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)."""

    ranks: int  # local ranks on each node
    nodes: int
    node_rank: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.ranks * self.nodes

    @property
    def rank(self) -> int:
        return self.node_rank * self.ranks + self.local_rank

    def env(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.ranks),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def check_group(cfg: ModelServiceConfig) -> None:
    """Refuse at start a group the model cannot be split over (ValueError naming the numbers)."""
    w = cfg.world_size
    if w == 1:
        return
    args = Checkpoint(cfg.model).args if os.path.isdir(cfg.model) else preset(cfg.model)
    counts = {"routed experts": args.n_routed_experts, "DSpark routed experts": args.dspark_n_routed_experts}
    for name, experts in counts.items():
        if experts % w:
            raise ValueError(
                f"--ranks {cfg.ranks} × --nodes {cfg.nodes} = {w} ranks do not divide the model's {experts} {name}"
            )
    if cfg.device.startswith("cuda:"):
        raise ValueError(f"--device {cfg.device}: a rank group takes one GPU per local rank (--device cuda or auto)")


def rank_device(cfg: ModelServiceConfig, local_rank: int) -> str:
    """A rank's device: GPU `local_rank` when the replica runs on GPUs, else the CPU."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return f"cuda:{local_rank}"


# ------------------------------------------------------------------------------------------- marshalling
@dataclass(frozen=True)
class _Device:
    """A device tensor, sent through the host and put on the follower's own device."""

    tensor: torch.Tensor


def _marshal(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return _Device(value.cpu())
    return _inside(value, _marshal)


def _unmarshal(value: Any, device: torch.device) -> Any:
    if isinstance(value, _Device):
        return value.tensor.to(device)
    return _inside(value, lambda v: _unmarshal(v, device))


def _inside(value: Any, f: Callable[[Any], Any]) -> Any:
    """`value` with `f` applied to what it holds: the items of a list, plain tuple or dict, the fields of a dataclass
    (a block, an encoder state, a prefill's output); any other value as it is."""
    if isinstance(value, list):
        return [f(v) for v in value]
    if type(value) is tuple:
        return tuple(f(v) for v in value)
    if isinstance(value, dict):
        return {k: f(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        if all(field.init for field in fields):
            return type(value)(**{field.name: f(getattr(value, field.name)) for field in fields})
    return value


def _name(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def _resolve(name: str) -> Callable[..., Any]:
    module, _, qualname = name.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


@dataclass(frozen=True)
class Outcome:
    """How a rank's part of a plan went: its value (a spread call's), or the error it raised (a follower's as a
    RuntimeError naming the rank: the exception itself may not pickle)."""

    value: Any = None
    error: BaseException | None = None


# ------------------------------------------------------------------------------------------ model calls
class ModelCalls:
    """How the service calls the model: objects built on it (`new`) and functions run on it (`run`)."""

    world_size = 1

    def new(self, factory: Callable[..., Any], *args: Any, methods: Iterable[str] = (), **kwargs: Any) -> Any:
        """`factory(model, *args, **kwargs)`; calls of its `methods` run on every rank."""
        raise NotImplementedError

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(model, *args, **kwargs)` on every rank; this rank's result."""
        raise NotImplementedError


class LocalCalls(ModelCalls):
    """One process holding the whole model: the calls run here, nothing else."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def new(self, factory: Callable[..., Any], *args: Any, methods: Iterable[str] = (), **kwargs: Any) -> Any:
        return factory(self.model, *args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self.model, *args, **kwargs)


class GroupCalls(ModelCalls):
    """Rank 0 of a group: each call is broadcast as a plan, then run here."""

    def __init__(self, model: Transformer, group: RankGroup) -> None:
        self.model = model
        self.group = group
        self.world_size = group.layout.world_size
        self._ids = itertools.count()

    def new(self, factory: Callable[..., Any], *args: Any, methods: Iterable[str] = (), **kwargs: Any) -> Any:
        oid = next(self._ids)
        plan = ("new", oid, _name(factory), args, kwargs)
        local = self.group.replicate(plan, lambda: factory(self.model, *args, **kwargs))
        replica = Replicated(self.group, oid, local, frozenset(methods))
        weakref.finalize(replica, self.group.dropped.append, oid)  # the followers drop theirs with the next plan
        return replica

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.group.replicate(("run", _name(fn), args, kwargs), lambda: fn(self.model, *args, **kwargs))

    def spread(self, replica: Replicated, method: str, by_rank: list[tuple[Any, ...]]) -> list[Outcome]:
        """`method(*by_rank[r])` of rank r's object of `replica`, on every rank r → every rank's outcome, in rank
        order (values on this rank's device)."""
        if len(by_rank) != self.world_size:
            raise ValueError(f"{len(by_rank)} ranks' arguments for a group of {self.world_size}")
        local = getattr(replica._local, method)
        outcomes = self.group.execute(("spread", replica._oid, method, by_rank), lambda: local(*by_rank[0]))
        return [Outcome(_unmarshal(o.value, self.model.device), o.error) for o in outcomes]


class Replicated:
    """Rank 0's object of a group: its replicated methods reach every rank; anything else is read locally."""

    def __init__(self, group: RankGroup, oid: int, local: Any, methods: frozenset[str]) -> None:
        self._group, self._oid, self._local, self._methods = group, oid, local, methods

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._local, name)
        if name not in self._methods:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._group.replicate(("call", self._oid, name, args, kwargs), lambda: attr(*args, **kwargs))

        return call

    def __len__(self) -> int:
        return len(self._local)


# ------------------------------------------------------------------------------------------------ the group
class RankGroup:
    """This process's membership of a rank group: the process group, the plan channel, the children it spawned,
    and (on rank 0) the watcher that fails the group when a rank dies or goes silent."""

    def __init__(self, cfg: ModelServiceConfig, part: Part, log: Any) -> None:
        self.cfg, self.part, self.log = cfg, part, log
        self.layout = layout_of(cfg)
        self.children: list[subprocess.Popen[bytes]] = []
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []
        self.dropped: list[int] = []  # rank 0: replicated objects gone, to drop on the followers
        self._lock = threading.RLock()  # one plan at a time, whichever thread calls
        self._fail_lock = threading.Lock()
        self._closed = threading.Event()
        self.store: dist.TCPStore | None = None
        self.plans: Any = None
        self.rounds = Rounds()  # this rank's MoE rounds (`parallel`: the model counts them)
        self.parts_done = 0  # this rank's parts of plans, done
        self._plan_since: float | None = None  # rank 0: when the plan in flight began
        self.tables_fd: int | None = None  # the node's shared Engram table file (model.shared_tables)

    # ----------------------------------------------------------------------------------------- start-up
    def spawn(self) -> None:
        """Start this node's other local ranks (local rank 0 is this process), handing them the node's table file
        when they share host Engram tables."""
        env = {**os.environ, CONFIG_ENV: msgspec.json.encode(self.cfg).decode(), PART_ENV: self.part}
        if self.cfg.engram_store == "host" and self.layout.ranks > 1:
            self.tables_fd = SharedTables.create()
            env[FD_ENV] = str(self.tables_fd)
        fds = () if self.tables_fd is None else (self.tables_fd,)
        for local in range(1, self.layout.ranks):
            peer = Layout(**{**self.layout.__dict__, "local_rank": local})
            command = [sys.executable, "-m", "model_service.ranks"]
            self.children.append(subprocess.Popen(command, env={**env, **peer.env()}, pass_fds=fds))
        self.log.info("ranks_spawned", pids=[c.pid for c in self.children], **self.layout.env())

    def join(self) -> None:
        """Meet the other ranks: the store (hosted by rank 0), the process group, the plan channel."""
        lay, cfg = self.layout, self.cfg
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        self.store = dist.TCPStore(
            lay.master_addr, lay.master_port, lay.world_size, is_master=lay.rank == 0, timeout=timeout
        )
        backend = "nccl" if rank_device(cfg, lay.local_rank).startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=self.store, rank=lay.rank, world_size=lay.world_size, timeout=timeout)
        # Followers wait for the next plan as long as rank 0 is idle: only the watcher decides a rank is gone.
        self.plans = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))

    def parallel(self) -> Parallel:
        """This rank's place in the expert-parallel group, which attends data-parallel: each rank its own sequences
        (decode_svc.spread) or prompts (prefill_svc.passes)."""
        return Parallel(self.layout.world_size, self.layout.rank, data_parallel=True, rounds=self.rounds)

    @property
    def progress(self) -> int:
        """Steps this rank has taken in the group's plans: MoE rounds entered and plan parts done."""
        return self.rounds.entered + self.parts_done

    def start_watching(self) -> None:
        """Rank 0: watch every rank until the group closes; followers: beat, and exit when rank 0 is gone."""
        target = self._watch if self.layout.rank == 0 else self._beat
        threading.Thread(target=target, name="rank-watch", daemon=True).start()

    # ------------------------------------------------------------------------------------------- rank 0
    def calls(self, model: Transformer) -> GroupCalls:
        return GroupCalls(model, self)

    def execute(self, plan: tuple[Any, ...], local: Callable[[], Any]) -> list[Outcome]:
        """Broadcast `plan` to the followers, run it here (`local`), take every rank's report → the outcomes in rank
        order; a collective that fails fails the group."""
        with self._lock:
            if self.failure is not None:
                raise RankGroupError(self.failure)
            dropped, self.dropped = self.dropped, []
            self._plan_since = time.monotonic()
            try:
                return self._execute(dropped, plan, local)
            finally:
                self._plan_since = None

    def _execute(self, dropped: list[int], plan: tuple[Any, ...], local: Callable[[], Any]) -> list[Outcome]:
        try:
            dist.broadcast_object_list([(dropped, _marshal(plan))], src=0, group=self.plans)
        except Exception as exc:
            raise self.fail(self._dead_child() or f"a plan did not reach the ranks: {exc}") from exc
        try:
            mine = Outcome(local())
        except Exception as exc:
            if self.failure is not None or isinstance(exc, dist.DistError):
                raise self.fail(self._dead_child() or f"a collective failed: {exc}") from exc
            mine = Outcome(error=exc)
        self.parts_done += 1
        reports: list[Any] = [None] * self.layout.world_size
        try:
            dist.gather_object(None, reports, dst=0, group=self.plans)
        except Exception as exc:
            raise self.fail(self._dead_child() or f"a rank did not report on a plan: {exc}") from exc
        return [mine, *reports[1:]]

    def replicate(self, plan: tuple[Any, ...], local: Callable[[], Any]) -> Any:
        """`execute` a call every rank runs alike → rank 0's value, or its error raised; a follower that failed where
        rank 0 did not holds other state than rank 0 from now on: the group fails."""
        mine, *followers = self.execute(plan, local)
        if mine.error is not None:
            raise mine.error
        for outcome in followers:
            if outcome.error is not None:
                raise self.fail(f"{outcome.error} (rank 0 ran the same call without error)")
        return mine.value

    def fail(self, reason: str) -> RankGroupError:
        """Mark the group failed (once): kill the local ranks, tell the service; the error for the caller."""
        with self._fail_lock:
            first = self.failure is None
            if first:
                self.failure = reason
        if first:
            self.log.error("rank_group_failed", reason=reason)
            self.kill_children()
            for callback in self.on_failure:
                callback(reason)
        return RankGroupError(self.failure or reason)

    def _dead_child(self, wait_s: float = 1.0) -> str | None:
        """Why a collective failed, when a local rank died (a dead peer breaks the collective before its exit is
        seen): waits up to `wait_s` for one to be reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            for local, child in enumerate(self.children, 1):
                if child.poll() is not None:
                    rank = self.layout.rank + local
                    return f"rank {rank} (pid {child.pid}) exited with status {child.returncode}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def _watch(self) -> None:
        assert self.store is not None
        store = self._client()
        followers = range(1, self.layout.world_size)
        beats = {r: (-1, time.monotonic()) for r in followers}
        progress = (-1, time.monotonic())  # rank 0's, and when it last moved
        while not self._closed.wait(WATCH_INTERVAL_S) and self.failure is None:
            if dead := self._dead_child(0):
                self.fail(dead)
                return
            now = time.monotonic()
            try:
                for r in followers:
                    count = int(store.add(f"beat/{r}", 0))
                    if count != beats[r][0]:
                        beats[r] = (count, now)
                    elif now - beats[r][1] > self.cfg.rank_timeout_s:
                        self.fail(f"rank {r} has not answered for {self.cfg.rank_timeout_s:g} s")
                        return
                since = self._plan_since
                if self.progress != progress[0]:
                    progress = (self.progress, now)
                elif since is not None and now - max(progress[1], since) > self.cfg.stall_timeout_s:
                    self.fail(self._stalled(store))
                    return
                    return
            except Exception as exc:  # the store is ours: this process is failing
                self.fail(f"the group's store failed: {exc}")
                return

    def _stalled(self, store: dist.TCPStore) -> str:
        """Why the plan in flight has stood still for `stall_timeout_s`, naming the ranks behind the others (the
        hung ones: the rest wait for them in a collective, or for their report)."""
        steps = [self.progress, *(int(store.add(f"progress/{r}", 0)) for r in range(1, self.layout.world_size))]
        reason = f"the ranks have made no progress in a plan for {self.cfg.stall_timeout_s:g} s"
        if min(steps) == max(steps):
            return reason
        behind = [r for r, n in enumerate(steps) if n == min(steps)]
        return f"{reason}; behind the others: rank{'s' * (len(behind) > 1)} {', '.join(map(str, behind))}"

    def close(self) -> None:
        """Rank 0, stopping: the followers exit after the last plan; any that does not is killed."""
        self._closed.set()
        if self.failure is None:
            with self._lock:
                try:
                    dist.broadcast_object_list([None], src=0, group=self.plans)
                except Exception as exc:
                    self.log.warning("ranks_not_stopped", error=str(exc))
        self.reap_children()
        self.kill_children()

    def reap_children(self) -> None:
        """Wait up to STOP_WAIT_S in all for the local ranks to exit; kill those that do not."""
        deadline = time.monotonic() + STOP_WAIT_S
        for child in self.children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def kill_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            child.wait()

    # ---------------------------------------------------------------------------------------- followers
    def _client(self) -> dist.TCPStore:
        lay = self.layout
        return dist.TCPStore(
            lay.master_addr,
            lay.master_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=self.cfg.rank_timeout_s),
        )

    def _beat(self) -> None:
        """A follower's heartbeat, with its progress when that moved (rank 0 names the ranks a stalled plan waits
        for); its process ends at once when rank 0's store or its own parent is gone."""
        parent, posted = os.getppid(), 0
        try:
            store = self._client()
            while not self._closed.wait(self.cfg.rank_timeout_s / 5):
                store.add(f"beat/{self.layout.rank}", 1)
                if (progress := self.progress) != posted:
                    store.add(f"progress/{self.layout.rank}", progress - posted)
                    posted = progress
                if self.layout.local_rank and os.getppid() != parent:
                    raise RuntimeError("the service process that started this rank is gone")
        except Exception as exc:
            self.log.error("rank_leader_gone", rank=self.layout.rank, error=str(exc))
            self.kill_children()
            os._exit(1)

    def follow(self, model: Transformer) -> None:
        """A follower's loop: execute rank 0's plans on this rank's replicas until the group stops."""
        objects: dict[int, Any] = {}
        while True:
            received: list[Any] = [None]
            dist.broadcast_object_list(received, src=0, group=self.plans)
            if received[0] is None:
                return
            dropped, plan = received[0]
            for oid in dropped:
                objects.pop(oid, None)
            outcome = self._run(model, objects, *_unmarshal(plan, model.device))
            self.parts_done += 1
            dist.gather_object(outcome, None, dst=0, group=self.plans)

    def _run(self, model: Transformer, objects: dict[int, Any], kind: str, *rest: Any) -> Outcome:
        """A follower's part of a plan; what it raised (but a failed collective) goes back to rank 0 as text."""
        try:
            if kind == "new":
                oid, factory, args, kwargs = rest
                objects[oid] = _resolve(factory)(model, *args, **kwargs)
            elif kind == "call":
                oid, method, args, kwargs = rest
                getattr(objects[oid], method)(*args, **kwargs)
            elif kind == "spread":
                oid, method, by_rank = rest
                return Outcome(_marshal(getattr(objects[oid], method)(*by_rank[self.layout.rank])))
            else:
                fn, args, kwargs = rest
                _resolve(fn)(model, *args, **kwargs)
        except dist.DistError:
            raise
        except Exception as exc:
            self.log.error("plan_failed", plan=kind, exc_info=True)
            return Outcome(error=RuntimeError(f"rank {self.layout.rank}: {type(exc).__name__}: {exc}"))
        return Outcome()


def layout_of(cfg: ModelServiceConfig) -> Layout:
    local = int(os.environ.get("LOCAL_RANK", "0")) if CONFIG_ENV in os.environ else 0
    return Layout(cfg.ranks, cfg.nodes, cfg.node_rank, local, cfg.master_addr, cfg.master_port)


def load_rank(group: RankGroup) -> Transformer:
    """This rank's share of the model (its experts only, the node's Engram tables where it shares them), warmed up
    like a single process's — the same calls on every rank, so the warm-up's collectives meet."""
    from model_service.runtime import load_service_model

    cfg, lay = group.cfg, group.layout
    shared = None
    if group.tables_fd is not None:
        assert group.store is not None, "the group meets before it loads"
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        shared = SharedTables(group.tables_fd, lay.local_rank == 0, group.store, lay.node_rank, timeout)
    return load_service_model(cfg, part=group.part, device=rank_device(cfg, lay.local_rank), parallel=group.parallel(),
                              shared=shared)  # fmt: skip


def start_group(cfg: ModelServiceConfig, part: Part, log: Any) -> tuple[RankGroup, Transformer]:
    """The service process's side of a group: resolve where the Engram tables go (once a node: the ranks may share
    them), spawn the local ranks, meet them, load this rank's share."""
    from model_service.runtime import engram_placement

    check_group(cfg)
    placement = engram_placement(cfg.model, rank_device(cfg, 0), cfg.dtype, cfg.engram_store)
    group = RankGroup(msgspec.structs.replace(cfg, engram_store=placement), part, log)
    group.spawn()
    try:
        group.join()
        group.start_watching()
        model = load_rank(group)
    except BaseException:
        group.kill_children()
        raise
    return group, model


def follower_main(group: RankGroup, model: Transformer) -> int:
    """Follow plans until rank 0 stops the group (0) or a collective fails (1); local ranks end with this one."""
    try:
        group.follow(model)
    except Exception as exc:
        group.log.error("rank_failed", rank=group.layout.rank, error=str(exc))
        group.kill_children()
        return 1
    group._closed.set()
    group.reap_children()
    return 0


def main() -> int:
    """A spawned local rank: torchrun's environment and the replica's configuration from its service process."""
    from mesh.logging import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    cfg = msgspec.json.decode(os.environ[CONFIG_ENV], type=ModelServiceConfig)
    part: Part = os.environ[PART_ENV]  # type: ignore[assignment]
    log = configure_logging("model_service.ranks", level=cfg.log_level).bind(rank=int(os.environ["RANK"]))
    group = RankGroup(cfg, part, log)
    group.tables_fd = SharedTables.inherited()
    group.join()
    group.start_watching()
    model = load_rank(group)
    log.info("rank_ready", **group.layout.env())
    return follower_main(group, model)


if __name__ == "__main__":  # run as model_service.ranks, not __main__: the plans unpickle to that module's classes
    from model_service import ranks

    raise SystemExit(ranks.main())
