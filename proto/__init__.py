"""Protocol buffers of the mesh (`cache.v1`, `prefill.v1`, `decode.v1`, `gateway.v1`).

The generated `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` modules are committed; regenerate them with
`python -m proto.generate` after editing a `.proto` (a test fails when they are stale).
"""
