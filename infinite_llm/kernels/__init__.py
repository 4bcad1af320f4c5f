"""Device kernels for DistAttention and the dense layers, behind the signatures of their torch references.

:func:`partial_attention`, :func:`merge_partials` and :func:`write_kv` run the Triton kernels
(``paged_attention.py``, ``merge.py``, ``fused.py``) when the tensors are on CUDA and triton imports, else the
torch reference in ``core/attention.py``; :func:`rms_norm`, :func:`fused_add_rms_norm`, :func:`silu_and_mul` and
:func:`rope_qk` (``fused.py``, gathered in :data:`DENSE_OPS` for the model) likewise fall back to
``core/model.py``. ``INFINITE_LLM_TRITON=1`` forces the Triton path (tests run it on CPU under
``TRITON_INTERPRET=1``); ``INFINITE_LLM_TRITON=0`` forces torch. Triton is imported only when used, so this
package imports on machines without it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from infinite_llm.core import attention as reference
from infinite_llm.core import model as dense_reference
from infinite_llm.core.attention import PartialAttentionMetadata
from infinite_llm.core.model import DenseOps

ENV_FORCE = "INFINITE_LLM_TRITON"


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go to the Triton kernels: ``INFINITE_LLM_TRITON`` if set to 0/1, else
    CUDA with triton installed."""
    forced = os.environ.get(ENV_FORCE, "")
    if forced in ("0", "1"):
        return forced == "1"
    return device.type == "cuda" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def partial_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PartialAttentionMetadata,
    scale: float | None = None,
    *,
    max_query_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial_out [num_tokens, num_heads, head_dim], lse [num_tokens, num_heads] fp32)``.

    Same contract as :func:`infinite_llm.core.attention.partial_attention`; dispatched by :func:`use_triton`.
    ``max_query_len`` (the longest query run, when known: 1 for decode) spares the Triton launcher its one
    host sync, so the call can be captured in a CUDA graph; the torch reference does not need it.
    """
    if use_triton(query.device):
        from infinite_llm.kernels.paged_attention import triton_partial_attention

        return triton_partial_attention(query, k_cache, v_cache, meta, scale, max_query_len=max_query_len)
    return reference.partial_attention(query, k_cache, v_cache, meta, scale)


def merge_partials(
    partial_outs: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [num_tokens, num_heads, head_dim], lse [num_tokens, num_heads] fp32)`` of ``num_parts`` parts.

    Same contract as :func:`infinite_llm.core.attention.merge_partials`; dispatched by :func:`use_triton`.
    """
    first = partial_outs if isinstance(partial_outs, torch.Tensor) else next(iter(partial_outs), None)
    if first is not None and use_triton(first.device):
        from infinite_llm.kernels.merge import triton_merge_partials

        return triton_merge_partials(partial_outs, lses)
    return reference.merge_partials(partial_outs, lses)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Store ``key, value [num_new_tokens, num_kv_heads, head_dim]`` at ``slot_mapping [num_new_tokens]`` of
    ``k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]`` (in place; slots < 0 skipped).

    Same contract as :func:`infinite_llm.core.attention.write_kv`; dispatched by :func:`use_triton`.
    """
    if use_triton(key.device):
        from infinite_llm.kernels.fused import triton_write_kv

        return triton_write_kv(k_cache, v_cache, slot_mapping, key, value)
    return reference.write_kv(k_cache, v_cache, slot_mapping, key, value)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm`` of ``x [num_tokens, hidden]``: :func:`infinite_llm.core.model.rms_norm`, dispatched."""
    if use_triton(x.device):
        from infinite_llm.kernels.fused import triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    return dense_reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``, ``[num_tokens, hidden]`` each:
    :func:`infinite_llm.core.model.fused_add_rms_norm`, dispatched."""
    if use_triton(x.device):
        from infinite_llm.kernels.fused import triton_fused_add_rms_norm

        return triton_fused_add_rms_norm(x, residual, weight, eps)
    return dense_reference.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [num_tokens, 2 * intermediate]``: :func:`infinite_llm.core.model.silu_and_mul`,
    dispatched."""
    if use_triton(gate_up.device):
        from infinite_llm.kernels.fused import triton_silu_and_mul

        return triton_silu_and_mul(gate_up)
    return dense_reference.silu_and_mul(gate_up)


def rope_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim])`` rotated by ``cos, sin``:
    :func:`infinite_llm.core.model.rope_qk`, dispatched (the Triton outputs are contiguous, the torch ones views)."""
    if use_triton(qkv.device):
        from infinite_llm.kernels.fused import triton_rope_qk

        return triton_rope_qk(qkv, cos, sin, num_heads, num_kv_heads)
    return dense_reference.rope_qk(qkv, cos, sin, num_heads, num_kv_heads)


def dense_ops_for(device: torch.device) -> DenseOps:
    """The dense ops ``device`` dispatches to now (:func:`use_triton`): the Triton kernels or the torch
    references, called directly (a model forward resolves them once, not once per op and layer)."""
    if not use_triton(device):
        return dense_reference.TORCH_OPS
    from infinite_llm.kernels import fused

    return DenseOps(
        fused.triton_rms_norm, fused.triton_fused_add_rms_norm, fused.triton_silu_and_mul, fused.triton_rope_qk
    )


DENSE_OPS = DenseOps(rms_norm, fused_add_rms_norm, silu_and_mul, rope_qk, for_device=dense_ops_for)

__all__ = [
    "DENSE_OPS",
    "ENV_FORCE",
    "dense_ops_for",
    "fused_add_rms_norm",
    "merge_partials",
    "partial_attention",
    "rms_norm",
    "rope_qk",
    "silu_and_mul",
    "use_triton",
    "write_kv",
]
