"""Generated protobuf and gRPC modules of the infinite_llm.v1 protos (make proto)."""
