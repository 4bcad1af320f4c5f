"""Device kernels for DistAttention, behind the same signatures as their torch references in ``core/``.

:func:`partial_attention` and :func:`merge_partials` run the Triton kernels (``paged_attention.py``,
``merge.py``) when the tensors are on CUDA and triton imports, else the torch reference in
``core/attention.py``. ``INFINITE_LLM_TRITON=1`` forces the Triton path (tests run it on CPU under
``TRITON_INTERPRET=1``); ``INFINITE_LLM_TRITON=0`` forces torch. Triton is imported only when used, so this
package imports on machines without it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from infinite_llm.core import attention as reference
from infinite_llm.core.attention import PartialAttentionMetadata

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


__all__ = ["ENV_FORCE", "merge_partials", "partial_attention", "use_triton"]
