from infinite_llm.pb.v1 import generate_pb2 as _generate_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ComputeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ComputeStatsResponse(_message.Message):
    __slots__ = ("instance_id", "num_running", "num_waiting", "num_preemptions", "generated_tokens", "model")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_running: int
    num_waiting: int
    num_preemptions: int
    generated_tokens: int
    model: str
    def __init__(self, instance_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...
