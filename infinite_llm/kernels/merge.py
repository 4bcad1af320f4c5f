"""Triton merge of partial attention results: the DistAttention merge on the device.

Torch reference: :func:`infinite_llm.core.attention.merge_partials` (same math and edge cases).
``lse = logsumexp_j(lse_j)``, ``out = sum_j exp(lse_j - lse) * out_j``; the lse form of FlashAttention-2 and
vLLM's ``merge_attn_states``. A part with ``lse = -inf`` has weight 0 and its output is never loaded, so a
NaN there cannot leak; a row whose parts are all empty gets ``out = 0, lse = -inf``.
Also used by ``paged_attention.py`` to merge its split-KV partials.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.kernels._checks import FLOAT_DTYPES, check_device, check_dtype, check_shape, next_power_of_2

MAX_PARTS_PER_PASS = 64


@triton.jit
def _merge_kernel(
    outs_ptr,  # [num_parts, num_rows, head_dim] contiguous, any float
    lses_ptr,  # [num_parts, num_rows] fp32
    out_ptr,  # [num_rows, head_dim]
    lse_ptr,  # [num_rows] fp32
    num_parts,
    num_rows,
    head_dim,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row (token, head): two passes over the parts, max then weighted sum."""
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_P).to(tl.int64)  # offsets p * num_rows * head_dim may pass 2**31
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    ref = tl.full([], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        p = p0 + parts
        lse = tl.load(lses_ptr + p * num_rows + row, mask=p < num_parts, other=float("-inf"))
        ref = tl.maximum(ref, tl.max(lse, 0))
    ref = tl.where(ref == float("-inf"), 0.0, ref)  # all parts empty: exp(-inf - 0) = 0, no NaN
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        p = p0 + parts
        lse = tl.load(lses_ptr + p * num_rows + row, mask=p < num_parts, other=float("-inf"))
        w = tl.exp(lse - ref)  # (BLOCK_P,), 0 for empty parts
        offs = (p[:, None] * num_rows + row) * head_dim + d[None, :]
        o = tl.load(outs_ptr + offs, mask=(w > 0)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w[:, None] * o, 0)
        total += tl.sum(w, 0)
    safe = tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * head_dim + d, (acc / safe).to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + row, tl.where(total > 0, ref + tl.log(safe), float("-inf")))


def launch_merge(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge checked, contiguous ``outs [P, T, H, D]``, fp32 ``lses [P, T, H]`` into ``out``, ``lse``.

    ``out [T, H, D]`` (any float dtype) and fp32 ``lse [T, H]`` are written in place. No checks: callers
    validate (see :func:`triton_merge_partials`).
    """
    num_parts, num_tokens, num_heads, head_dim = outs.shape
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return
    # parts per pass: up to 64 load in one round (a split-KV decode on an H200 has ~32, launch_plan.py); a
    # [64, 128] fp32 tile is 64 registers per thread at 4 warps. A cap of 16 took 3 rounds in each pass.
    block_p = min(next_power_of_2(num_parts), MAX_PARTS_PER_PASS)
    _merge_kernel[(num_rows,)](
        outs,
        lses,
        out,
        lse,
        num_parts,
        num_rows,
        head_dim,
        BLOCK_P=block_p,
        BLOCK_D=next_power_of_2(head_dim),
    )


def triton_merge_partials(
    partial_outs: Sequence[torch.Tensor] | torch.Tensor, lses: Sequence[torch.Tensor] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attention results over disjoint sets of keys, on the device.

    Args:
        partial_outs: ``[num_parts, num_tokens, num_heads, head_dim]`` fp32/fp16/bf16 (or a sequence of
            ``[num_tokens, num_heads, head_dim]``), on CUDA (CPU under ``TRITON_INTERPRET=1``).
        lses: ``[num_parts, num_tokens, num_heads]`` float (or a sequence), natural log; cast to fp32.

    Returns:
        ``(out [num_tokens, num_heads, head_dim]`` in the dtype of ``partial_outs``, ``lse [num_tokens,
        num_heads]`` fp32``)``; rows whose parts all have ``lse = -inf`` get ``out = 0, lse = -inf``.

    Raises:
        InvalidRequest: no parts, mismatched shapes, a non-float dtype, or tensors off the device.
    """
    outs, ls = _stacked(partial_outs), _stacked(lses)
    if outs.dim() != 4:
        raise InvalidRequest(f"partial_outs has shape {tuple(outs.shape)}; expected [P, T, H, D]")
    if outs.shape[0] == 0:
        raise InvalidRequest("merge_partials needs at least one part")
    check_shape("lses", ls, tuple(outs.shape[:3]))
    check_dtype("partial_outs", outs, FLOAT_DTYPES)
    check_dtype("lses", ls, FLOAT_DTYPES)
    check_device(_merge_kernel, {"partial_outs": outs, "lses": ls})
    outs, ls = outs.contiguous(), ls.float().contiguous()
    out = torch.empty(outs.shape[1:], dtype=outs.dtype, device=outs.device)
    lse = torch.empty(ls.shape[1:], dtype=torch.float32, device=outs.device)
    launch_merge(outs, ls, out, lse)
    return out, lse


def _stacked(parts: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """One stacked ``[num_parts, ...]`` tensor; raises :class:`InvalidRequest` for an empty sequence."""
    if isinstance(parts, torch.Tensor):
        return parts
    if len(parts) == 0:
        raise InvalidRequest("merge_partials needs at least one part")
    return torch.stack(list(parts))
