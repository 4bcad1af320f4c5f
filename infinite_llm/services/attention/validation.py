"""Checks of a step's opening and of each layer's tensors against the server's KV layout, before any change.

``RManager.plan_step`` already checks ownership; this adds what a remote caller can get wrong on top:
counts, head counts, dtypes and shapes against the layout and the plan, and non-finite values.
Every failure raises :class:`~infinite_llm.core.errors.InvalidRequest` naming the sequence and field.
"""

from __future__ import annotations

import numpy as np
import torch

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.ids import check_id
from infinite_llm.core.rmanager import KVLayout, SeqStep
from infinite_llm.services.attention.types import ServerStep


def check_step_open(seqs: list[SeqStep], num_heads: int, layout: KVLayout) -> None:
    """Validate a step's opening: at least one sequence, each with a well-formed id (``core/ids.py``),
    ``num_computed_tokens >= 0`` and ``num_new >= 1``, and a query head count that fits the layout: a
    malformed opening is INVALID_ARGUMENT before any sequence is looked up.

    Ownership and duplicates are ``RManager.plan_step``'s preconditions, checked there.
    """
    if not seqs:
        raise InvalidRequest("a step must name at least one sequence")
    for s in seqs:
        check_id("seq_id", s.seq_id)
        if s.num_computed_tokens < 0 or s.num_new < 1:
            raise InvalidRequest(
                f"sequence {s.seq_id!r}: num_computed_tokens {s.num_computed_tokens} must be >= 0 and "
                f"num_new {s.num_new} >= 1"
            )
    if num_heads < 1 or num_heads % layout.num_kv_heads:
        raise InvalidRequest(f"num_heads {num_heads} is not a positive multiple of {layout.num_kv_heads}")


def check_layer(
    step: ServerStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: KVLayout
) -> None:
    """Dtypes, shapes against the step's plan, and finiteness of one layer's tensors (read back once: on a
    GPU, one host sync per layer rather than one per tensor)."""
    want = {
        "query": [step.plan.num_tokens, step.num_heads, layout.head_dim],
        "key": [step.plan.num_new_here, layout.num_kv_heads, layout.head_dim],
        "value": [step.plan.num_new_here, layout.num_kv_heads, layout.head_dim],
    }
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if t.dtype != layout.dtype or list(t.shape) != want[name]:
            raise InvalidRequest(f"{name} is {t.dtype} {list(t.shape)}, the step needs {layout.dtype} {want[name]}")
    for name, ok in zip(tensors, all_finite(list(tensors.values())), strict=True):
        if not ok:
            raise InvalidRequest(f"{name} holds NaN or infinite values")


# Dtypes checked through numpy on the CPU: those it reads as they are, and bfloat16 through its bits.
_NUMPY_READABLE = (torch.float32, torch.float16, torch.float64, torch.bfloat16)
_BF16_EXPONENT = np.int16(0x7F80)


def all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds only finite values.

    CPU tensors are read through numpy (no copy; bfloat16 by its bits): a decode layer's query and K/V at
    batch 16 take ~15 us there against ~55-80 us for torch's ``isfinite().all()`` of the three, whose
    per-op overhead dominates at these sizes (``benchmarks/attention_server_layer.py``). CUDA tensors
    (the torch transport) are reduced on their device and read back once: one host sync, not one per
    tensor.
    """
    if all(t.device.type == "cpu" and t.dtype in _NUMPY_READABLE for t in tensors):
        return [_finite_on_cpu(t) for t in tensors]
    return torch.stack([torch.isfinite(t).all() for t in tensors]).tolist()


def _finite_on_cpu(t: torch.Tensor) -> bool:
    """numpy's check of one CPU tensor; bfloat16 (which numpy lacks) by its bits: a value is NaN or
    infinite exactly when its 8 exponent bits are all ones (``0x7F80`` of the 16)."""
    if t.dtype == torch.bfloat16:
        bits = t.detach().view(torch.int16).numpy()
        return bool((np.bitwise_and(bits, _BF16_EXPONENT) != _BF16_EXPONENT).all())
    return bool(np.isfinite(t.detach().numpy()).all())


def check_payload_values(payload: torch.Tensor) -> None:
    """A block-transfer payload must be finite: a NaN or inf key/value would poison every attention over
    the rBlock (softmax of NaN is NaN), for its sequence and silently."""
    if not bool(torch.isfinite(payload).all()):
        raise InvalidRequest("payload holds NaN or infinite values", param="payload")


def check_payload(shape: list[int], dtype: torch.dtype, layout: KVLayout) -> int:
    """Validate a block-transfer payload ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.

    Returns ``num_blocks`` (>= 1). Raises ``InvalidRequest`` when shape or dtype differ from ``layout``.
    """
    want = [2, layout.num_layers, None, layout.block_size, layout.num_kv_heads, layout.head_dim]
    ok = len(shape) == 6 and all(w is None or w == s for w, s in zip(want, shape, strict=True))
    if not ok or dtype != layout.dtype or shape[2] < 1:
        raise InvalidRequest(
            f"payload {dtype} {list(shape)} does not match this server's layout: "
            f"{layout.dtype} [2, {layout.num_layers}, num_blocks >= 1, {layout.block_size}, "
            f"{layout.num_kv_heads}, {layout.head_dim}]"
        )
    return shape[2]
