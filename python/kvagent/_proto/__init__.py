"""Messages and gRPC stubs generated from proto/kvagent.proto (python/gen_stubs.py)."""
