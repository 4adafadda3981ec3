"""What every service shares: typed configuration, structured logging, metrics, the gRPC server
bootstrap (health + reflection), block keys, and the CLI that runs the whole mesh locally."""
