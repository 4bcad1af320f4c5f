"""Generated protobuf code (``make proto`` from ``protos/``); checked in so installs need no protoc."""
