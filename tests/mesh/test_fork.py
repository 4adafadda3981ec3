"""The mesh forks its children while gRPC runs in the parent: gRPC must not follow them across the fork
(mesh/__init__.py turns its fork support off)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a fresh interpreter (gRPC reads the setting when first imported): mesh first, as `python -m mesh` imports it,
# then 60 children forked as the mesh forks them while four threads keep calling a health check.
PARENT = """
import sys, threading
from concurrent import futures
from pathlib import Path

from mesh.processes import Child
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
done = threading.Event()

def poll():
    while not done.is_set():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)

pollers = [threading.Thread(target=poll) for _ in range(4)]
for thread in pollers:
    thread.start()
statuses = []
for i in range(60):
    child = Child(f"c{i}", [sys.executable, "-c", "pass"], "", lambda: True, Path(sys.argv[1]) / f"c{i}.log", "")
    child.spawn({})
    statuses.append(child.wait(30))
done.set()
for thread in pollers:
    thread.join()
server.stop(None)
print(statuses)
"""


def test_children_fork_without_grpc_fork_handlers(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    parent = subprocess.run(
        [sys.executable, "-c", PARENT, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert parent.returncode == 0, parent.stderr
    assert parent.stdout.strip() == str([0] * 60)
    # with fork support on, nearly every fork beside busy pollers logs this (98 of 100 forks here)
    assert "fork() handlers" not in parent.stderr, parent.stderr[-2000:]
    children = "".join(log.read_text() for log in tmp_path.glob("c*.log")).splitlines()
    assert all(line.startswith("--- ") for line in children), children  # each log only its header: gRPC said nothing
