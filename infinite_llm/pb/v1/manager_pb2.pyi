from infinite_llm.pb.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("server_id", "address", "capacity_blocks", "block_size", "kind", "node_name", "layout")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    capacity_blocks: int
    block_size: int
    kind: str
    node_name: str
    layout: _tensor_pb2.KVLayout
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., kind: _Optional[str] = ..., node_name: _Optional[str] = ..., layout: _Optional[_Union[_tensor_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_ttl_s",)
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: int
    def __init__(self, lease_ttl_s: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("server_id", "free_blocks", "used_blocks", "num_sequences", "sequences", "reserved", "reports_sequences", "draining", "address")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    REPORTS_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    free_blocks: int
    used_blocks: int
    num_sequences: int
    sequences: _containers.RepeatedCompositeFieldContainer[SeqBlocks]
    reserved: _containers.RepeatedCompositeFieldContainer[SeqBlocks]
    reports_sequences: bool
    draining: bool
    address: str
    def __init__(self, server_id: _Optional[str] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SeqBlocks, _Mapping]]] = ..., reserved: _Optional[_Iterable[_Union[SeqBlocks, _Mapping]]] = ..., reports_sequences: _Optional[bool] = ..., draining: _Optional[bool] = ..., address: _Optional[str] = ...) -> None: ...

class SeqBlocks(_message.Message):
    __slots__ = ("seq_id", "num_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_blocks: int
    def __init__(self, seq_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("server_id", "address")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("seq_id", "num_blocks", "near_server_id", "first_block_index", "block_size", "instance_id", "admission")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEAR_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_blocks: int
    near_server_id: str
    first_block_index: int
    block_size: int
    instance_id: str
    admission: bool
    def __init__(self, seq_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., near_server_id: _Optional[str] = ..., first_block_index: _Optional[int] = ..., block_size: _Optional[int] = ..., instance_id: _Optional[str] = ..., admission: _Optional[bool] = ...) -> None: ...

class BlockGrant(_message.Message):
    __slots__ = ("server_id", "address", "block_ids")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("grants",)
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[BlockGrant]
    def __init__(self, grants: _Optional[_Iterable[_Union[BlockGrant, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_freed",)
    NUM_FREED_FIELD_NUMBER: _ClassVar[int]
    num_freed: int
    def __init__(self, num_freed: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("seq_id", "block_hashes", "block_size", "instance_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    instance_id: str
    def __init__(self, seq_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("grants",)
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[BlockGrant]
    def __init__(self, grants: _Optional[_Iterable[_Union[BlockGrant, _Mapping]]] = ...) -> None: ...

class PrefixBlock(_message.Message):
    __slots__ = ("seq_id", "block_index", "block_hash", "server_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_index: int
    block_hash: bytes
    server_id: str
    def __init__(self, seq_id: _Optional[str] = ..., block_index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., server_id: _Optional[str] = ...) -> None: ...

class PublishPrefixRequest(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[PrefixBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[PrefixBlock, _Mapping]]] = ...) -> None: ...

class PublishPrefixResponse(_message.Message):
    __slots__ = ("num_indexed",)
    NUM_INDEXED_FIELD_NUMBER: _ClassVar[int]
    num_indexed: int
    def __init__(self, num_indexed: _Optional[int] = ...) -> None: ...

class ClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerState(_message.Message):
    __slots__ = ("server_id", "address", "capacity_blocks", "free_blocks", "used_blocks", "num_sequences", "block_size", "node_name", "cached_blocks", "draining")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    capacity_blocks: int
    free_blocks: int
    used_blocks: int
    num_sequences: int
    block_size: int
    node_name: str
    cached_blocks: int
    draining: bool
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., block_size: _Optional[int] = ..., node_name: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("seq_id", "shares", "instance_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    shares: _containers.RepeatedCompositeFieldContainer[KVShare]
    instance_id: str
    def __init__(self, seq_id: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[KVShare, _Mapping]]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class KVShare(_message.Message):
    __slots__ = ("server_id", "num_blocks")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    num_blocks: int
    def __init__(self, server_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ClusterStateResponse(_message.Message):
    __slots__ = ("servers", "ledger", "compute_instances", "manager_id", "leading_for_s", "refused", "waiting_admissions")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    MANAGER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADING_FOR_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    WAITING_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerState]
    ledger: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    compute_instances: _containers.RepeatedCompositeFieldContainer[ComputeInstanceState]
    manager_id: str
    leading_for_s: float
    refused: _containers.RepeatedCompositeFieldContainer[RefusedRegistration]
    waiting_admissions: _containers.RepeatedCompositeFieldContainer[WaitingAdmission]
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerState, _Mapping]]] = ..., ledger: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., compute_instances: _Optional[_Iterable[_Union[ComputeInstanceState, _Mapping]]] = ..., manager_id: _Optional[str] = ..., leading_for_s: _Optional[float] = ..., refused: _Optional[_Iterable[_Union[RefusedRegistration, _Mapping]]] = ..., waiting_admissions: _Optional[_Iterable[_Union[WaitingAdmission, _Mapping]]] = ...) -> None: ...

class WaitingAdmission(_message.Message):
    __slots__ = ("seq_id", "instance_id", "num_blocks", "waiting_s", "holding")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    HOLDING_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    instance_id: str
    num_blocks: int
    waiting_s: float
    holding: bool
    def __init__(self, seq_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., waiting_s: _Optional[float] = ..., holding: _Optional[bool] = ...) -> None: ...

class RefusedRegistration(_message.Message):
    __slots__ = ("kind", "member_id", "address", "reason", "attempts", "first_refused_ago_s", "last_refused_ago_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_REFUSED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    LAST_REFUSED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    kind: str
    member_id: str
    address: str
    reason: str
    attempts: int
    first_refused_ago_s: float
    last_refused_ago_s: float
    def __init__(self, kind: _Optional[str] = ..., member_id: _Optional[str] = ..., address: _Optional[str] = ..., reason: _Optional[str] = ..., attempts: _Optional[int] = ..., first_refused_ago_s: _Optional[float] = ..., last_refused_ago_s: _Optional[float] = ...) -> None: ...

class RegisterComputeRequest(_message.Message):
    __slots__ = ("instance_id", "address", "home_server_ids", "node_name", "layout")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOME_SERVER_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    home_server_ids: _containers.RepeatedScalarFieldContainer[str]
    node_name: str
    layout: _tensor_pb2.KVLayout
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., home_server_ids: _Optional[_Iterable[str]] = ..., node_name: _Optional[str] = ..., layout: _Optional[_Union[_tensor_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class RegisterComputeResponse(_message.Message):
    __slots__ = ("lease_ttl_s",)
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: int
    def __init__(self, lease_ttl_s: _Optional[int] = ...) -> None: ...

class HeartbeatComputeRequest(_message.Message):
    __slots__ = ("instance_id", "num_running", "num_waiting", "num_tokens_held", "seq_ids", "reports_seq_ids", "num_steps", "mean_step_s", "migration_results", "address", "waiting_seq_ids", "reports_waiting_seq_ids")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STEP_S_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_RESULTS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_WAITING_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_running: int
    num_waiting: int
    num_tokens_held: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    reports_seq_ids: bool
    num_steps: int
    mean_step_s: float
    migration_results: _containers.RepeatedCompositeFieldContainer[MigrationResult]
    address: str
    waiting_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    reports_waiting_seq_ids: bool
    def __init__(self, instance_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_tokens_held: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ..., reports_seq_ids: _Optional[bool] = ..., num_steps: _Optional[int] = ..., mean_step_s: _Optional[float] = ..., migration_results: _Optional[_Iterable[_Union[MigrationResult, _Mapping]]] = ..., address: _Optional[str] = ..., waiting_seq_ids: _Optional[_Iterable[str]] = ..., reports_waiting_seq_ids: _Optional[bool] = ...) -> None: ...

class MigrationOrder(_message.Message):
    __slots__ = ("migration_id", "seq_id", "src_server_id", "src_address", "dst_server_id", "dst_address", "reservation_ids", "block_indices", "drain")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    migration_id: int
    seq_id: str
    src_server_id: str
    src_address: str
    dst_server_id: str
    dst_address: str
    reservation_ids: _containers.RepeatedScalarFieldContainer[int]
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    drain: bool
    def __init__(self, migration_id: _Optional[int] = ..., seq_id: _Optional[str] = ..., src_server_id: _Optional[str] = ..., src_address: _Optional[str] = ..., dst_server_id: _Optional[str] = ..., dst_address: _Optional[str] = ..., reservation_ids: _Optional[_Iterable[int]] = ..., block_indices: _Optional[_Iterable[int]] = ..., drain: _Optional[bool] = ...) -> None: ...

class MigrationResult(_message.Message):
    __slots__ = ("migration_id", "seq_id", "src_server_id", "dst_server_id", "num_blocks", "num_moved", "bytes_moved", "error", "cached_hashes", "block_indices")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    migration_id: int
    seq_id: str
    src_server_id: str
    dst_server_id: str
    num_blocks: int
    num_moved: int
    bytes_moved: int
    error: str
    cached_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, migration_id: _Optional[int] = ..., seq_id: _Optional[str] = ..., src_server_id: _Optional[str] = ..., dst_server_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., error: _Optional[str] = ..., cached_hashes: _Optional[_Iterable[bytes]] = ..., block_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatComputeResponse(_message.Message):
    __slots__ = ("migrations",)
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    migrations: _containers.RepeatedCompositeFieldContainer[MigrationOrder]
    def __init__(self, migrations: _Optional[_Iterable[_Union[MigrationOrder, _Mapping]]] = ...) -> None: ...

class DeregisterComputeRequest(_message.Message):
    __slots__ = ("instance_id", "address")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class DeregisterComputeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListComputeInstancesRequest(_message.Message):
    __slots__ = ("include_debts",)
    INCLUDE_DEBTS_FIELD_NUMBER: _ClassVar[int]
    include_debts: bool
    def __init__(self, include_debts: _Optional[bool] = ...) -> None: ...

class ComputeInstanceState(_message.Message):
    __slots__ = ("instance_id", "address", "home_server_ids", "node_name", "num_running", "num_waiting", "num_tokens_held", "debt_blocks", "heartbeat_age_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOME_SERVER_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    DEBT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    home_server_ids: _containers.RepeatedScalarFieldContainer[str]
    node_name: str
    num_running: int
    num_waiting: int
    num_tokens_held: int
    debt_blocks: int
    heartbeat_age_s: float
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., home_server_ids: _Optional[_Iterable[str]] = ..., node_name: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_tokens_held: _Optional[int] = ..., debt_blocks: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ...) -> None: ...

class ListComputeInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[ComputeInstanceState]
    def __init__(self, instances: _Optional[_Iterable[_Union[ComputeInstanceState, _Mapping]]] = ...) -> None: ...
