"""The one tensor codec: torch tensors to and from ``infinite_llm.v1.Tensor``, and ~1 MiB chunking.

Wire format (``protos/infinite_llm/v1/tensor.proto``): dtype name, shape, and the elements row-major,
little-endian, without padding. Encoding costs one copy (protobuf ``bytes`` must own its buffer; a
non-contiguous or CUDA tensor adds its ``contiguous()`` / ``cpu()`` copy). Decoding costs none: the tensor
is ``torch.frombuffer`` over the received ``bytes`` and therefore **read-only** - copy it before writing
into it. bfloat16 has no numpy dtype, so bytes always travel as a ``uint8`` view. Big payloads are
streamed in ~1 MiB chunks (ENV.md: one 32 MiB unary message is ~5x slower than 1 MiB chunks).

Neighbours: services decode requests and encode replies with these functions only; no other module
touches ``Tensor.data``.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.pb.v1 import tensor_pb2

if TYPE_CHECKING:
    from infinite_llm.core.rmanager import KVLayout

assert sys.byteorder == "little", "the Tensor wire format is little-endian"

CHUNK_BYTES = 1 << 20  # 1 MiB: the streaming sweet spot measured in ENV.md

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# Decoded tensors alias immutable ``bytes`` on purpose (zero-copy); the module docstring says so.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype. Raises ``InvalidRequest`` for a dtype the wire format lacks."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidRequest(f"dtype {dtype} cannot travel as a Tensor; supported: {sorted(DTYPES)}") from None


def kv_layout_message(layout: KVLayout) -> tensor_pb2.KVLayout:
    """The wire form of a KV layout (what an attention server keeps, or a compute instance needs)."""
    return tensor_pb2.KVLayout(
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=dtype_name(layout.dtype),
    )


def dtype_from_name(name: str, *, field: str = "tensor") -> torch.dtype:
    """Torch dtype of a wire name. Raises ``InvalidRequest`` naming ``field`` for an unknown name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidRequest(f"{field}: unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Row-major bytes of ``t`` (any shape, a supported dtype, any device and strides): one copy."""
    dtype_name(t.dtype)
    flat = t.detach().cpu().contiguous().reshape(-1)  # (numel,), no copy when already contiguous on CPU
    return flat.view(torch.uint8).numpy().tobytes()  # uint8 view: bf16 has no numpy dtype


def encode_tensor(t: torch.Tensor, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """``t`` as a ``Tensor`` message (filled into ``out`` when given, e.g. a sub-message field)."""
    msg = tensor_pb2.Tensor() if out is None else out
    msg.dtype = dtype_name(t.dtype)
    msg.shape[:] = list(t.shape)
    msg.data = tensor_to_bytes(t)
    return msg


def tensor_meta(dtype: torch.dtype, shape: Sequence[int]) -> tensor_pb2.Tensor:
    """A data-less ``Tensor`` that describes a payload streamed separately in chunks."""
    return tensor_pb2.Tensor(dtype=dtype_name(dtype), shape=list(shape))


def payload_nbytes(meta: tensor_pb2.Tensor, *, field: str = "payload") -> int:
    """Bytes a ``Tensor`` of ``meta``'s dtype and shape occupies. Raises ``InvalidRequest`` if malformed."""
    dtype = dtype_from_name(meta.dtype, field=field)
    _check_shape(meta.shape, field)
    return math.prod(meta.shape) * dtype.itemsize


def decode_tensor(msg: tensor_pb2.Tensor, *, field: str = "tensor") -> torch.Tensor:
    """A read-only CPU tensor viewing ``msg.data`` (no copy).

    Raises:
        InvalidRequest: unknown dtype, a negative dimension, or ``len(data)`` not ``prod(shape) * itemsize``;
            the message names ``field``.
    """
    return tensor_from_buffer(msg.dtype, msg.shape, msg.data, field=field)


def tensor_from_buffer(
    dtype: str, shape: Sequence[int], buffer: bytes | bytearray | memoryview, *, field: str = "tensor"
) -> torch.Tensor:
    """View ``buffer`` as a tensor of wire dtype ``dtype`` and ``shape`` without copying.

    Writable when ``buffer`` is (a ``bytearray``), read-only for ``bytes``. Raises ``InvalidRequest``
    as :func:`decode_tensor`.
    """
    torch_dtype = dtype_from_name(dtype, field=field)
    _check_shape(shape, field)
    want = math.prod(shape) * torch_dtype.itemsize
    if len(buffer) != want:
        raise InvalidRequest(
            f"{field}: {len(buffer)} data bytes do not match shape {list(shape)} of {dtype} ({want} bytes)"
        )
    if want == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    return torch.frombuffer(buffer, dtype=torch_dtype).view(tuple(shape))


def split_chunks(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """``data`` in order, as consecutive pieces of ``chunk_bytes`` bytes (the last may be shorter)."""
    if chunk_bytes <= 0:
        raise InvalidRequest(f"chunk_bytes must be positive, got {chunk_bytes}")
    view = memoryview(data)
    for start in range(0, len(view), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


class ChunkAssembler:
    """Reassembles a payload of a known size from chunks into one preallocated, writable buffer.

    Raises ``InvalidRequest`` when the chunks add up to more than ``total_bytes`` (in :meth:`add`) or to
    fewer (in :meth:`finish`).
    """

    def __init__(self, total_bytes: int) -> None:
        if total_bytes < 0:
            raise InvalidRequest(f"payload size must be >= 0, got {total_bytes}")
        self.buffer = bytearray(total_bytes)
        self.received = 0

    def add(self, chunk: bytes) -> None:
        end = self.received + len(chunk)
        if end > len(self.buffer):
            raise InvalidRequest(f"payload overflows its declared size of {len(self.buffer)} bytes")
        self.buffer[self.received : end] = chunk
        self.received = end

    def finish(self) -> bytearray:
        if self.received != len(self.buffer):
            raise InvalidRequest(f"payload ended after {self.received} of {len(self.buffer)} bytes")
        return self.buffer


def join_chunks(chunks: Iterable[bytes], total_bytes: int) -> bytearray:
    """Concatenate ``chunks`` into a writable buffer of exactly ``total_bytes`` bytes."""
    assembler = ChunkAssembler(total_bytes)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def _check_shape(shape: Sequence[int], field: str) -> None:
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"{field}: negative dimension in shape {list(shape)}")
