"""Tensor channels: a standalone 2-rank torch.distributed process group per (compute instance, attention
server) pair, over which the tensors of AttendStream steps travel while gRPC keeps the control.

Both sides build their rank here: the compute instance (rank 0) hosts the rendezvous ``TCPStore``; the
attention server (rank 1) joins it when asked by ``OpenTensorChannel``. No global ``init_process_group``:
each pair is its own group (gloo on CPU, NCCL between GPUs), so pairs come and go independently. Bytes
travel as flat ``uint8`` buffers (one per layer and direction) whose layout both sides derive from the
shape the step's ``StepOpen`` declares (:class:`StepSizes`); tags are unique per (step, layer, direction),
so a message of a failed step can never be matched by a later one. Source: PyTorch
``distributed_c10d._new_process_group_helper`` (how a group is built from a store without the default group).
"""

from __future__ import annotations

import datetime
import functools
import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
TO_SERVER, TO_COMPUTE = 0, 1  # tag directions
MAX_LAYERS = 1024  # layers a tag can tell apart
_TAG_STEPS = (1 << 31) // (2 * MAX_LAYERS)  # steps before tags repeat (~1M: far longer than any stale message)
ACCEPTED = "accepted/"  # store key prefix the server sets once it agreed to join a channel
STATUS_BYTES = 8  # a reply opens with one int64 status (8 bytes also keeps the fp32 lse after it aligned)
LAYER_OK, LAYER_FAILED = 0, 1  # reply statuses; a failed layer's error ends the step's gRPC stream


def layer_tag(step_id: int, layer: int, direction: int) -> int:
    """A non-negative int32 tag, unique per (step modulo ~1M, layer, direction)."""
    if not 0 <= layer < MAX_LAYERS:
        raise ValueError(f"layer {layer} out of range for a tensor channel (< {MAX_LAYERS})")
    return ((step_id % _TAG_STEPS) * MAX_LAYERS + layer) * 2 + direction


def host_towards(peer_host: str) -> str:
    """This machine's address on the route to ``peer_host`` (what the peer can reach us at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer_host, 9))  # UDP: picks the route, sends nothing
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def buffer_device(backend: str, device: torch.device) -> torch.device:
    """Where a channel's buffers live: the GPU for NCCL, the CPU for gloo."""
    return device if backend == "nccl" else torch.device("cpu")


def pair_group(
    store: dist.Store, channel_id: str, rank: int, backend: str, host: str, timeout_s: float
) -> dist.ProcessGroup:
    """Rank ``rank`` (0: compute, 1: attention server) of the 2-rank group of ``channel_id``; blocks until
    the other rank joins (at most ``timeout_s`` seconds). ``host``: this side's address for gloo."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"channel/{channel_id}/", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    if backend != "gloo":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._threads = 1  # point-to-point only: the worker threads serve collectives
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat ``uint8`` buffer on ``device`` holding each tensor's row-major bytes, in order."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]  # (nbytes_i,)
    return torch.cat(parts).to(device)


class Field(NamedTuple):
    """Where one tensor lies in a flat ``uint8`` buffer: bytes ``[start, end)``, its dtype and shape."""

    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def fields(shapes: Sequence[tuple[torch.dtype, tuple[int, ...]]], offset: int = 0) -> tuple[Field, ...]:
    """The :class:`Field` of each ``(dtype, shape)``, laid out back to back from byte ``offset``."""
    out, start = [], offset
    for dtype, shape in shapes:
        end = start + math.prod(shape) * dtype.itemsize
        out.append(Field(start, end, dtype, tuple(shape)))
        start = end
    return tuple(out)


def unpack(buffer: torch.Tensor, layout: Sequence[Field]) -> list[torch.Tensor]:
    """Views of ``buffer`` (``uint8``, as :func:`pack` made it) as the tensors ``layout`` places in it."""
    return [buffer[f.start : f.end].view(f.dtype).view(f.shape) for f in layout]


@dataclass(frozen=True)
class StepSizes:
    """Byte sizes of one layer of a channel step, fixed by the step's shape, never by the context.

    ``layer_nbytes``: q|k|v, ``query [num_tokens, num_heads, head_dim]`` then ``key, value [num_kv_rows,
    num_kv_heads, head_dim]`` in ``dtype``. ``reply_nbytes``: the int64 status, then ``lse [num_tokens,
    num_heads]`` fp32, then ``partial_out [num_tokens, num_heads, head_dim]`` in ``dtype``. The layouts are
    computed once per shape (a decode step repeats one shape every layer).
    """

    num_tokens: int
    num_heads: int
    num_kv_rows: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @functools.cached_property
    def layer_fields(self) -> tuple[Field, ...]:
        """query, key, value in a layer's q|k|v buffer."""
        n, h, kv, hkv, d = self.num_tokens, self.num_heads, self.num_kv_rows, self.num_kv_heads, self.head_dim
        return fields([(self.dtype, (n, h, d)), (self.dtype, (kv, hkv, d)), (self.dtype, (kv, hkv, d))])

    @functools.cached_property
    def reply_fields(self) -> tuple[Field, ...]:
        """lse, partial_out in a reply buffer (after its status)."""
        n, h, d = self.num_tokens, self.num_heads, self.head_dim
        return fields([(torch.float32, (n, h)), (self.dtype, (n, h, d))], offset=STATUS_BYTES)

    @property
    def layer_nbytes(self) -> int:
        return (
            (self.num_tokens * self.num_heads + 2 * self.num_kv_rows * self.num_kv_heads)
            * self.head_dim
            * (self.dtype.itemsize)
        )

    @property
    def reply_nbytes(self) -> int:
        rows = self.num_tokens * self.num_heads
        return STATUS_BYTES + rows * 4 + rows * self.head_dim * self.dtype.itemsize


@functools.lru_cache(maxsize=256)
def step_sizes(
    num_tokens: int, num_heads: int, num_kv_rows: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> StepSizes:
    """The (cached) :class:`StepSizes` of a shape: decode steps repeat a few shapes every layer."""
    return StepSizes(num_tokens, num_heads, num_kv_rows, num_kv_heads, head_dim, dtype)


def failed_reply(nbytes: int, device: torch.device) -> torch.Tensor:
    """The reply buffer of a failed layer (``uint8 [nbytes]``): the ``LAYER_FAILED`` status, then zeros (the
    peer posted a receive of exactly ``nbytes``)."""
    out = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    out[:STATUS_BYTES] = torch.tensor([LAYER_FAILED], dtype=torch.int64).view(torch.uint8).to(device)
    return out


class ReplyBuffer:
    """One step's reply buffer, reused by each of its layers: the ``LAYER_OK`` status is written once,
    each layer copies its ``lse`` and ``partial_out`` into place (:meth:`fill`). Reuse is safe because a
    channel waits for a layer's send before it receives the next layer (``TensorChannel._settle``)."""

    def __init__(self, sizes: StepSizes, device: torch.device) -> None:
        self.buffer = torch.empty(sizes.reply_nbytes, dtype=torch.uint8, device=device)  # (reply_nbytes,)
        self.buffer[:STATUS_BYTES] = torch.tensor([LAYER_OK], dtype=torch.int64).view(torch.uint8).to(device)
        self._lse, self._out = unpack(self.buffer, sizes.reply_fields)

    def fill(self, lse: torch.Tensor, partial_out: torch.Tensor) -> torch.Tensor:
        """The buffer holding ``lse [num_tokens, num_heads]`` (fp32) and ``partial_out [num_tokens,
        num_heads, head_dim]``; raises ``ValueError`` when their shapes are not the step's (``copy_`` would
        broadcast)."""
        if lse.shape != self._lse.shape or partial_out.shape != self._out.shape:
            raise ValueError(
                f"a reply of lse {list(lse.shape)}, partial_out {list(partial_out.shape)} does not fit the step's "
                f"{list(self._lse.shape)}, {list(self._out.shape)}"
            )
        self._lse.copy_(lse)
        self._out.copy_(partial_out)
        return self.buffer


def reply_status(buffer: torch.Tensor) -> int:
    """The int64 status a reply buffer (``uint8``) opens with."""
    return int(buffer[:STATUS_BYTES].cpu().view(torch.int64)[0])
