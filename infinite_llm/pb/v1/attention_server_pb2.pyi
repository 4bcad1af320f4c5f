from infinite_llm.pb.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveBlocksRequest(_message.Message):
    __slots__ = ("seq_id", "num_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_blocks: int
    def __init__(self, seq_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ReserveBlocksResponse(_message.Message):
    __slots__ = ("reservation_id", "block_ids", "uncached_hashes")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    UNCACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    uncached_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, reservation_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., uncached_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitBlocksRequest(_message.Message):
    __slots__ = ("reservation_id", "block_indices")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_id: _Optional[int] = ..., block_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitBlocksResponse(_message.Message):
    __slots__ = ("seq_id", "block_ids", "cached_hashes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., cached_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CancelReservationRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class CancelReservationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FreeSequenceRequest(_message.Message):
    __slots__ = ("seq_id", "block_indices", "from_block_index")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    FROM_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    from_block_index: int
    def __init__(self, seq_id: _Optional[str] = ..., block_indices: _Optional[_Iterable[int]] = ..., from_block_index: _Optional[int] = ...) -> None: ...

class FreeSequenceResponse(_message.Message):
    __slots__ = ("num_freed", "num_held")
    NUM_FREED_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_FIELD_NUMBER: _ClassVar[int]
    num_freed: int
    num_held: int
    def __init__(self, num_freed: _Optional[int] = ..., num_held: _Optional[int] = ...) -> None: ...

class StepSeq(_message.Message):
    __slots__ = ("seq_id", "num_computed_tokens", "num_new", "num_blocks_here")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_HERE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_computed_tokens: int
    num_new: int
    num_blocks_here: int
    def __init__(self, seq_id: _Optional[str] = ..., num_computed_tokens: _Optional[int] = ..., num_new: _Optional[int] = ..., num_blocks_here: _Optional[int] = ...) -> None: ...

class StepOpen(_message.Message):
    __slots__ = ("step_id", "seqs", "num_heads", "tensor_channel", "num_kv_rows", "dtype", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_ROWS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[StepSeq]
    num_heads: int
    tensor_channel: str
    num_kv_rows: int
    dtype: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, step_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[StepSeq, _Mapping]]] = ..., num_heads: _Optional[int] = ..., tensor_channel: _Optional[str] = ..., num_kv_rows: _Optional[int] = ..., dtype: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LayerInput(_message.Message):
    __slots__ = ("layer", "query", "key", "value")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    query: _tensor_pb2.Tensor
    key: _tensor_pb2.Tensor
    value: _tensor_pb2.Tensor
    def __init__(self, layer: _Optional[int] = ..., query: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., key: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StepEnd(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    def __init__(self, step_id: _Optional[int] = ...) -> None: ...

class AttendStreamRequest(_message.Message):
    __slots__ = ("open", "layer", "end")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    open: StepOpen
    layer: LayerInput
    end: StepEnd
    def __init__(self, open: _Optional[_Union[StepOpen, _Mapping]] = ..., layer: _Optional[_Union[LayerInput, _Mapping]] = ..., end: _Optional[_Union[StepEnd, _Mapping]] = ...) -> None: ...

class LayerPartial(_message.Message):
    __slots__ = ("layer", "partial_out", "lse")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_OUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    partial_out: _tensor_pb2.Tensor
    lse: _tensor_pb2.Tensor
    def __init__(self, layer: _Optional[int] = ..., partial_out: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., lse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class OpenTensorChannelRequest(_message.Message):
    __slots__ = ("channel_id", "store_host", "store_port", "backend", "timeout_ms")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    store_host: str
    store_port: int
    backend: str
    timeout_ms: int
    def __init__(self, channel_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class OpenTensorChannelResponse(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: str
    def __init__(self, device: _Optional[str] = ...) -> None: ...

class CloseTensorChannelRequest(_message.Message):
    __slots__ = ("channel_id",)
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    def __init__(self, channel_id: _Optional[str] = ...) -> None: ...

class CloseTensorChannelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportBlocksRequest(_message.Message):
    __slots__ = ("seq_id", "block_ids", "chunk_bytes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class BlockTransferHeader(_message.Message):
    __slots__ = ("seq_id", "block_ids", "payload", "reservation_id", "block_indices", "block_hashes", "stage", "reservation_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    payload: _tensor_pb2.Tensor
    reservation_id: int
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    stage: bool
    reservation_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., payload: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., reservation_id: _Optional[int] = ..., block_indices: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., stage: _Optional[bool] = ..., reservation_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockTransferChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BlockTransferHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BlockTransferHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImportBlocksResponse(_message.Message):
    __slots__ = ("seq_id", "block_ids", "cached_hashes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., cached_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AttachBlocksRequest(_message.Message):
    __slots__ = ("seq_id", "first_block_index", "block_hashes", "reserve")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    first_block_index: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    reserve: bool
    def __init__(self, seq_id: _Optional[str] = ..., first_block_index: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., reserve: _Optional[bool] = ...) -> None: ...

class AttachBlocksResponse(_message.Message):
    __slots__ = ("block_ids", "uncached_hashes", "reservation_id")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    UNCACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    uncached_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    reservation_id: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., uncached_hashes: _Optional[_Iterable[bytes]] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class CacheBlocksRequest(_message.Message):
    __slots__ = ("seq_id", "block_indices", "block_hashes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq_id: _Optional[str] = ..., block_indices: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CacheBlocksResponse(_message.Message):
    __slots__ = ("cached_hashes",)
    CACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    cached_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, cached_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlockReadersRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlockReader(_message.Message):
    __slots__ = ("block_hash", "seq_id", "block_index")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    seq_id: str
    block_index: int
    def __init__(self, block_hash: _Optional[bytes] = ..., seq_id: _Optional[str] = ..., block_index: _Optional[int] = ...) -> None: ...

class BlockReadersResponse(_message.Message):
    __slots__ = ("readers",)
    READERS_FIELD_NUMBER: _ClassVar[int]
    readers: _containers.RepeatedCompositeFieldContainer[BlockReader]
    def __init__(self, readers: _Optional[_Iterable[_Union[BlockReader, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("server_id", "layout", "num_blocks", "num_free", "num_used", "num_reserved", "num_sequences", "bytes_per_block", "capacity_bytes", "used_bytes", "num_cached")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    layout: _tensor_pb2.KVLayout
    num_blocks: int
    num_free: int
    num_used: int
    num_reserved: int
    num_sequences: int
    bytes_per_block: int
    capacity_bytes: int
    used_bytes: int
    num_cached: int
    def __init__(self, server_id: _Optional[str] = ..., layout: _Optional[_Union[_tensor_pb2.KVLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., num_free: _Optional[int] = ..., num_used: _Optional[int] = ..., num_reserved: _Optional[int] = ..., num_sequences: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_cached: _Optional[int] = ...) -> None: ...
