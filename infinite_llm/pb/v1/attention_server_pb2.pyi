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
    __slots__ = ("reservation_id", "block_ids")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitBlocksRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class CommitBlocksResponse(_message.Message):
    __slots__ = ("seq_id", "block_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CancelReservationRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class CancelReservationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FreeSequenceRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class FreeSequenceResponse(_message.Message):
    __slots__ = ("num_freed",)
    NUM_FREED_FIELD_NUMBER: _ClassVar[int]
    num_freed: int
    def __init__(self, num_freed: _Optional[int] = ...) -> None: ...

class SeqAttend(_message.Message):
    __slots__ = ("seq_id", "query", "query_positions", "context_len", "block_ids", "block_indices", "slot_mapping", "key", "value")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    QUERY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    query: _tensor_pb2.Tensor
    query_positions: _containers.RepeatedScalarFieldContainer[int]
    context_len: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    key: _tensor_pb2.Tensor
    value: _tensor_pb2.Tensor
    def __init__(self, seq_id: _Optional[str] = ..., query: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., query_positions: _Optional[_Iterable[int]] = ..., context_len: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_indices: _Optional[_Iterable[int]] = ..., slot_mapping: _Optional[_Iterable[int]] = ..., key: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AttendStepRequest(_message.Message):
    __slots__ = ("layer", "seqs")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    seqs: _containers.RepeatedCompositeFieldContainer[SeqAttend]
    def __init__(self, layer: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SeqAttend, _Mapping]]] = ...) -> None: ...

class SeqPartial(_message.Message):
    __slots__ = ("seq_id", "partial_out", "lse")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_OUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    partial_out: _tensor_pb2.Tensor
    lse: _tensor_pb2.Tensor
    def __init__(self, seq_id: _Optional[str] = ..., partial_out: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., lse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AttendStepResponse(_message.Message):
    __slots__ = ("partials",)
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    partials: _containers.RepeatedCompositeFieldContainer[SeqPartial]
    def __init__(self, partials: _Optional[_Iterable[_Union[SeqPartial, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("seq_id", "block_ids", "payload", "reservation_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    payload: _tensor_pb2.Tensor
    reservation_id: int
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., payload: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class BlockTransferChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BlockTransferHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BlockTransferHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImportBlocksResponse(_message.Message):
    __slots__ = ("seq_id", "block_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("server_id", "layout", "num_blocks", "num_free", "num_used", "num_reserved", "num_sequences", "bytes_per_block", "capacity_bytes", "used_bytes")
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
    def __init__(self, server_id: _Optional[str] = ..., layout: _Optional[_Union[_tensor_pb2.KVLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., num_free: _Optional[int] = ..., num_used: _Optional[int] = ..., num_reserved: _Optional[int] = ..., num_sequences: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...
