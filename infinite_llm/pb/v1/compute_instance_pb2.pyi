from infinite_llm.pb.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ComputeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ComputeStatsResponse(_message.Message):
    __slots__ = ("instance_id", "num_running", "num_waiting", "num_preemptions", "generated_tokens", "model", "layer_rpc_seconds", "layer_rpc_count", "server_rpc_seconds", "prefix_cache_queries", "prefix_cache_hits")
    class ServerRpcSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_RPC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_RPC_COUNT_FIELD_NUMBER: _ClassVar[int]
    SERVER_RPC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_running: int
    num_waiting: int
    num_preemptions: int
    generated_tokens: int
    model: str
    layer_rpc_seconds: float
    layer_rpc_count: int
    server_rpc_seconds: _containers.ScalarMap[str, float]
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, instance_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., model: _Optional[str] = ..., layer_rpc_seconds: _Optional[float] = ..., layer_rpc_count: _Optional[int] = ..., server_rpc_seconds: _Optional[_Mapping[str, float]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...
