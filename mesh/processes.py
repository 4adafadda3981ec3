"""The local mesh as child processes: a cache, prefill and decode replicas and gateways on loopback ports.

`Mesh` starts them (each `python -m <package> serve ...`, logging to DATA_DIR/logs/<name>.log), waits until every
one answers its health check (gRPC health for the services, GET /health for the gateway), and stops them in
reverse order of dependence: the gateway drains first, the cache last. Children run in their own session (a Ctrl-C
reaches only the parent, which stops them in order) and, on Linux, get SIGTERM if the parent dies without stopping
them, so no child outlives its mesh. DATA_DIR/mesh.json describes the running mesh (addresses, pids, logs).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import httpx
import msgspec
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEALTH_TIMEOUT_S = 1.0
POLL_INTERVAL_S = 0.2
PR_SET_PDEATHSIG = 1


class MeshError(RuntimeError):
    """The mesh cannot start (or keep running); the message says which child and shows its last log lines."""


class MeshSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to run. `*_args` are extra flags for every process of that role."""

    model: str
    data_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    prefill_replicas: int = 1
    decode_replicas: int = 1
    # Gateways in front of the same replicas, as a load balancer would spread clients over them; the first keeps
    # `port` (when given), the others get free ports.
    gateway_replicas: int = 1
    # Rank processes of each prefill / decode replica (their --ranks; each group meets on a free port of its own).
    prefill_ranks: int = 1
    decode_ranks: int = 1
    api_key: str = ""
    cache_args: Sequence[str] = ()
    prefill_args: Sequence[str] = ()
    decode_args: Sequence[str] = ()
    gateway_args: Sequence[str] = ()


_PYTHON_M = (sys.executable, "-m")  # every child is `python -m <package> serve ...`

# Ports at most this far below the kernel's ephemeral range are candidates for free_port.
_PORT_SPAN = 10_000
# The ports free_port handed out last, never handed out again until they leave: a mesh draws all its ports before its
# children bind any, and two draws of one port would make two of its children race for it.
_GIVEN: deque[int] = deque(maxlen=256)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing holds now, for a server started later.

    Chosen at random below the kernel's ephemeral range: the kernel hands ports in that range to every port-0 bind
    and outgoing connection, so a port found free there can be taken before the server binds it (CI once lost a
    metrics port that way). Below it only another process's free_port caller can, one chance in thousands; this
    process's callers never get one port twice in a row of `_GIVEN`'s length."""
    low = _ephemeral_low()
    candidates = range(max(1024, low - _PORT_SPAN), low)
    for _ in range(64):
        port = random.choice(candidates) if candidates else 0
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            port = int(sock.getsockname()[1])
        _GIVEN.append(port)
        return port
    raise OSError(f"no free port on {host} in {candidates.start}..{candidates.stop - 1}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _metrics_endpoint(host: str) -> tuple[list[str], str]:
    """A service's metrics flags on a port of its own, and the URL Prometheus scrapes there."""
    port = free_port(host)
    return ["--metrics-host", host, "--metrics-port", str(port)], f"http://{host}:{port}/metrics"


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux), so a killed mesh leaves no orphans."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def http_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def gateway_sees(url: str, prefill: int, decode: int, cache: int) -> bool:
    """The gateway is ready and its own polls reach every replica and cache shard (so a first request cannot meet
    a connection still backing off)."""
    try:
        answer = httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    if answer.status_code != 200:
        return False
    try:
        health = answer.json()
    except ValueError:  # another server holds the port: the gateway will fail to bind it and exit
        return False
    if not isinstance(health, dict):
        return False
    return (
        health.get("replicas_up") == {"prefill": prefill, "decode": decode} and health.get("cache_shards_up") == cache
    )


class Child:
    """One process of the mesh."""

    def __init__(
        self, name: str, argv: list[str], address: str, healthy: Callable[[], bool], log: Path, metrics: str
    ) -> None:
        self.name = name
        self.argv = argv
        self.address = address
        self.metrics = metrics  # the URL Prometheus scrapes
        self.healthy = healthy
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self._log_from = 0  # where the current run's lines start in `log`

    def ready_line(self, after_s: float) -> str:
        return f"{self.name:<10} ready after {after_s:5.1f} s   {self.address:<22}  {self.metrics}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self, env: dict[str, str]) -> None:
        with self.log.open("ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(self.argv)}\n".encode())
            out.flush()
            self._log_from = out.tell()  # this run's lines start here
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def terminate(self) -> None:
        if self.running():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int | None:
        """Exit status after at most `timeout_s`; a child still running then is killed (status None)."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None

    def tail(self, lines: int = 15) -> str:
        """The last lines this run of the child wrote to its log."""
        try:
            with self.log.open("rb") as fh:
                fh.seek(self._log_from)
                text = fh.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])


START_ATTEMPTS = 3
_BIND_FAILURES = ("Failed to bind to address", "Address already in use", "address already in use")


def _lost_port(child: Child) -> bool:
    """Whether a child exited because its port was taken."""
    return not child.running() and any(text in child.tail(40) for text in _BIND_FAILURES)


class Mesh:
    """A local mesh: `start()`, use `base_url` (or `base_urls`, one per gateway), `stop()` (or `with Mesh(spec) as
    mesh:`)."""

    def __init__(self, spec: MeshSpec, on_event: Callable[[str], None] = lambda line: None) -> None:
        if spec.gateway_replicas < 1:
            raise MeshError(f"gateway_replicas must be at least 1, not {spec.gateway_replicas}")
        self.spec = spec
        self.on_event = on_event
        self.data_dir = Path(spec.data_dir).expanduser().resolve()
        self.logs = self.data_dir / "logs"
        self._plan()
        self._env = self._environment()

    def _plan(self) -> None:
        """The children and their addresses, on ports drawn now (`start` draws again when one was taken meanwhile)."""
        spec, host = self.spec, self.spec.host
        cache_address = f"{host}:{free_port(host)}"
        metrics_args, metrics = _metrics_endpoint(host)
        self.children: list[Child] = [
            Child(
                "cache",
                [*_PYTHON_M, "cache_svc", "serve", "--host", host, "--port", cache_address.rsplit(":", 1)[1],
                 "--data-dir", str(self.data_dir / "cache"), *metrics_args, *spec.cache_args],
                cache_address,
                functools.partial(grpc_serving, cache_address),
                self.logs / "cache.log",
                metrics,
            )
        ]  # fmt: skip
        workers: dict[str, list[str]] = {"prefill": [], "decode": []}
        for role, count, ranks, extra in (
            ("prefill", spec.prefill_replicas, spec.prefill_ranks, spec.prefill_args),
            ("decode", spec.decode_replicas, spec.decode_ranks, spec.decode_args),
        ):
            for index in range(count):
                address = f"{host}:{free_port(host)}"
                workers[role].append(address)
                metrics_args, metrics = _metrics_endpoint(host)
                group = ["--ranks", str(ranks), "--master-addr", host, "--master-port", str(free_port(host))]
                argv = [*_PYTHON_M, f"{role}_svc", "serve", "--host", host, "--port", address.rsplit(":", 1)[1],
                        *metrics_args, "--model", spec.model, "--cache", cache_address,
                        *(group if ranks > 1 else []), *extra]  # fmt: skip
                name = f"{role}-{index}"
                healthy = functools.partial(grpc_serving, address)
                self.children.append(Child(name, argv, address, healthy, self.logs / f"{name}.log", metrics))
        self.base_urls: list[str] = []  # every gateway's, in order; base_url is the first
        self.grpc_addresses: list[str] = []
        for index in range(spec.gateway_replicas):
            self.children.append(self._gateway(index, workers, cache_address))
        self.base_url = self.base_urls[0]
        self.grpc_address = self.grpc_addresses[0]

    def _gateway(self, index: int, workers: dict[str, list[str]], cache_address: str) -> Child:
        """Gateway `index` over every replica; the first keeps `spec.port` (when given), the others get free ports.
        Every gateway keeps stored Responses in the one file under the data directory, so they share them."""
        spec, host = self.spec, self.spec.host
        port = (spec.port if index == 0 else 0) or free_port(host)
        url, grpc_address = f"http://{host}:{port}", f"{host}:{free_port(host)}"
        self.base_urls.append(url)
        self.grpc_addresses.append(grpc_address)
        argv = [*_PYTHON_M, "gateway", "serve", "--host", host, "--port", str(port), "--grpc-port",
                grpc_address.rsplit(":", 1)[1], "--prefill", ",".join(workers["prefill"]),
                "--decode", ",".join(workers["decode"]), "--cache", cache_address,
                "--response-store", str(self.data_dir / "responses.sqlite3"), *spec.gateway_args]  # fmt: skip
        # One gateway keeps the name it always had; several are numbered like the replicas.
        name = "gateway" if spec.gateway_replicas == 1 else f"gateway-{index}"
        healthy = functools.partial(gateway_sees, url, spec.prefill_replicas, spec.decode_replicas, 1)
        return Child(name, argv, url, healthy, self.logs / f"{name}.log", f"{url}/metrics")

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.spec.api_key:
            env["GATEWAY_API_KEY"] = self.spec.api_key
        # One torch process per replica on a shared machine: split the cores instead of oversubscribing them.
        torch_processes = self.spec.prefill_replicas + self.spec.decode_replicas
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // torch_processes)))
        return env

    def child(self, name: str) -> Child:
        for child in self.children:
            if child.name == name:
                return child
        raise KeyError(f"no child named {name!r}; children: {', '.join(c.name for c in self.children)}")

    def start(self, timeout_s: float = 600.0, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Start every child and wait until all are healthy; on failure (or `cancelled()`) stop them all and raise
        MeshError. A child that could not bind its port (another process took it between the draw and the bind) is
        no failure of the mesh: the ports are drawn again and everything restarts, up to `START_ATTEMPTS` times."""
        self.logs.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        for attempt in range(1, START_ATTEMPTS + 1):
            for child in self.children:
                child.spawn(self._env)
            try:
                self._wait_healthy(self.children, started, timeout_s, cancelled)
                break
            except MeshError as error:
                self.stop()
                if attempt == START_ATTEMPTS or not any(_lost_port(c) for c in self.children):
                    raise
                self.on_event(f"a port was taken before its child bound it ({error}); drawing new ports")
                self._plan()
            except BaseException:
                self.stop()
                raise
        self.write_state()

    def restart(self, *names: str, timeout_s: float = 600.0) -> None:
        """Start the named children again (stopping any still running) and wait until all are healthy."""
        children = [self.child(name) for name in names]
        for child in children:
            child.terminate()
        for child in children:
            child.wait(10.0)
        started = time.monotonic()
        for child in children:
            child.spawn(self._env)
        self._wait_healthy(children, started, timeout_s)
        self.write_state()

    def dead(self) -> list[Child]:
        """Children that exited on their own."""
        return [c for c in self.children if c.process is not None and not c.running()]

    def stop(self, timeout_s: float = 30.0) -> dict[str, int | None]:
        """SIGTERM in order (gateway, then prefill and decode, then the cache), SIGKILL after `timeout_s`."""
        codes: dict[str, int | None] = {}
        for group in (["gateway"], ["prefill", "decode"], ["cache"]):
            members = [c for c in self.children if c.name.split("-")[0] in group]
            for child in members:
                child.terminate()
            for child in members:
                codes[child.name] = child.wait(timeout_s)
        return codes

    def write_state(self) -> None:
        state = {
            "base_url": self.base_url,
            "grpc": self.grpc_address,
            "base_urls": self.base_urls,
            "grpc_addresses": self.grpc_addresses,
            "model": self.spec.model,
            "children": {
                c.name: {"pid": c.pid, "address": c.address, "metrics": c.metrics, "log": str(c.log)}
                for c in self.children
            },
        }
        path = self.data_dir / "mesh.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, path)  # a reader never sees a half-written file (it is rewritten when a child restarts)

    def _wait_healthy(
        self, children: list[Child], started: float, timeout_s: float, cancelled: Callable[[], bool] = lambda: False
    ) -> None:
        pending = list(children)
        while pending:
            if cancelled():
                raise MeshError("start-up interrupted")
            for child in list(pending):
                if not child.running():
                    code = child.process.returncode if child.process else None
                    raise MeshError(
                        f"{child.name} exited with status {code} while starting; {child.log}:\n{child.tail()}"
                    )
                if child.healthy():
                    pending.remove(child)
                    self.on_event(child.ready_line(time.monotonic() - started))
            if pending and time.monotonic() - started > timeout_s:
                names = ", ".join(c.name for c in pending)
                raise MeshError(f"{names} not healthy after {timeout_s:g} s; {pending[0].log}:\n{pending[0].tail()}")
            if pending:
                time.sleep(POLL_INTERVAL_S)

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
