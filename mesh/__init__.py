"""What every service shares: typed configuration, structured logging, metrics, the gRPC server
bootstrap (health + reflection), block keys, and the CLI that runs the whole mesh locally."""

import os

# The mesh forks its children, to give them their death signal before exec (`mesh.processes`). With gRPC's fork
# support on (grpcio's build default), a fork restarts gRPC's poller threads in the child, which may abort on the
# descriptors the child closes before exec, and fails calls in flight in the parent: beside four threads polling
# a health check, 2 of 2,000 forked children aborted and 36 printed gRPC errors (none with it off). Nothing here
# uses gRPC across a fork, so it is off; gRPC reads this when first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
