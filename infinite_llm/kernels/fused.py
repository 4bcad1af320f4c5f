"""Fused Triton kernels for the dense layers and the KV store: one launch where torch takes several.

Torch references: :func:`infinite_llm.core.model.rms_norm`, :func:`~infinite_llm.core.model.fused_add_rms_norm`,
:func:`~infinite_llm.core.model.silu_and_mul`, :func:`~infinite_llm.core.model.rope_qk` and
:func:`infinite_llm.core.attention.write_kv` (same signatures). The fusions are vLLM's custom ops
``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` (q and k in one launch) and
``reshape_and_cache`` (K and V in one launch, slots < 0 skipped); the norm has HF ``LlamaRMSNorm`` semantics.
Each op rounds where its torch reference rounds (bf16 after the add, after the norm and before the weight,
after silu and after the product; in the rotation after the first product and after the FMA), so on a GPU the
add, the rotation and the copy equal the CPU torch path bit for bit, fp32 and bf16, and the norm and silu
differ by a few fp32 ulps (sum order, ``rsqrt``/``exp``), which in bf16 moves under 2% of the outputs by one
ulp (``tests/kernels/test_fused_cuda.py``, run on an H200).

Launchers read shapes and strides only (no ``.item()``, no data-dependent shapes), so they can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_dtype,
    check_shape,
    next_power_of_2,
)

SILU_BLOCK = 1024  # elements of one row per program: a decode row of I = 8192 spreads over 8 programs


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden, stride_x, stride_r, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per token row: ``[residual_out =] residual + x``, then the HF RMSNorm of that row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # torch: add in fp32, round to the dtype
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype)  # HF: cast to the input dtype, then multiply by the weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * hidden + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, inter, stride_row, BLOCK: tl.constexpr):
    """Program (row, tile): ``silu(gate) * up`` of ``BLOCK`` columns; gate is ``[:inter]``, up ``[inter:]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_row + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # torch rounds silu's result before the product
    tl.store(out_ptr + row * inter + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


@triton.jit
def _rope_qk_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr,
    num_heads, num_kv_heads, stride_qkv_t, stride_qkv_h, stride_cos_t, stride_sin_t,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Program (token, head) over the ``num_heads + num_kv_heads`` q and k heads: ``[x1*c - x2*s, x2*c + x1*s]``.

    Rounded as torch's ``mul`` (the first product, to the dtype) then ``addcmul_``, which torch's CPU kernel
    computes as one fp32 FMA (checked: its fp32 result is the fused one) and rounds once to the dtype.
    """
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    src = qkv_ptr + t * stride_qkv_t + head * stride_qkv_h + d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    c = tl.load(cos_ptr + t * stride_cos_t + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin_t + d, mask=mask, other=0.0).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = tl.fma(-x2f, s, (x1f * c).to(x1.dtype).to(tl.float32)).to(x1.dtype)  # x1*c - x2*s
    o2 = tl.fma(x1f, s, (x2f * c).to(x1.dtype).to(tl.float32)).to(x1.dtype)  # x2*c + x1*s
    is_q = head < num_heads
    q_dst = q_ptr + (t * num_heads + tl.minimum(head, num_heads - 1)) * (2 * HALF) + d
    k_dst = k_ptr + (t * num_kv_heads + tl.maximum(head - num_heads, 0)) * (2 * HALF) + d
    tl.store(q_dst, o1, mask=mask & is_q)
    tl.store(q_dst + HALF, o2, mask=mask & is_q)
    tl.store(k_dst, o1, mask=mask & ~is_q)
    tl.store(k_dst + HALF, o2, mask=mask & ~is_q)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    head_dim, row_len, block_size,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per new token: its K and V rows (``num_kv_heads * head_dim``) into slot ``slot``, if >= 0."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    keep = slot >= 0  # a padding row of a CUDA-graph batch has slot -1: nothing is written
    slot = tl.maximum(slot, 0)
    block, offset = slot // block_size, slot % block_size
    i = tl.arange(0, BLOCK)
    mask = (i < row_len) & keep
    h, d = i // head_dim, i % head_dim
    key = tl.load(key_ptr + t * stride_key_t + h * stride_key_h + d, mask=mask)
    value = tl.load(value_ptr + t * stride_value_t + h * stride_value_h + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + h * stride_kc_h + d
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + h * stride_vc_h + d
    tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm`` of ``x [num_tokens, hidden]``; ``weight [hidden]`` of ``x``'s dtype (fp32/fp16/bf16).

    Returns a new contiguous ``[num_tokens, hidden]`` tensor. Raises :class:`InvalidRequest` on bad shapes,
    dtypes or devices.
    """
    return _launch_rms_norm(x, None, weight, eps)[0]


def triton_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``, both new ``[num_tokens, hidden]`` tensors of ``x``'s dtype.

    ``x`` (a sublayer's output) and ``residual`` are ``[num_tokens, hidden]`` of one dtype; the sum is rounded
    to that dtype before the norm, as in torch. Source: vLLM ``fused_add_rms_norm`` (out of place here).
    Raises :class:`InvalidRequest` on bad shapes, dtypes or devices.
    """
    check_shape("residual", residual, tuple(x.shape))
    check_dtype("residual", residual, (x.dtype,))
    normed, new_residual = _launch_rms_norm(x, residual, weight, eps)
    assert new_residual is not None
    return normed, new_residual


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks, then one launch: ``(normed, residual + x or None)``, one program per row of ``x``."""
    if x.dim() != 2:
        raise InvalidRequest(f"x has shape {tuple(x.shape)}; expected [num_tokens, hidden]")
    num_tokens, hidden = x.shape
    check_dtype("x", x, FLOAT_DTYPES)
    check_shape("weight", weight, (hidden,))
    check_dtype("weight", weight, (x.dtype,))
    tensors = {"x": x, "weight": weight} | ({} if residual is None else {"residual": residual})
    check_device(_rms_norm_kernel, tensors)
    x, weight = _rows_contiguous(x), weight.contiguous()
    residual = None if residual is None else _rows_contiguous(residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = None if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, new_residual
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, x if residual is None else residual, weight, out, out if new_residual is None else new_residual,
        hidden, x.stride(0), 0 if residual is None else residual.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
    )  # fmt: skip
    return out, new_residual


def triton_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [num_tokens, 2 * intermediate]`` (gate first): ``[num_tokens, intermediate]``.

    Rounded as torch's ``silu(gate).mul_(up)``: silu in fp32, rounded to the dtype, then the product. Source:
    vLLM ``silu_and_mul``. Raises :class:`InvalidRequest` on bad shapes, dtypes or devices.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise InvalidRequest(f"gate_up has shape {tuple(gate_up.shape)}; expected [num_tokens, 2 * intermediate]")
    check_dtype("gate_up", gate_up, FLOAT_DTYPES)
    check_device(_silu_and_mul_kernel, {"gate_up": gate_up})
    gate_up = _rows_contiguous(gate_up)
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens and inter:
        block = min(next_power_of_2(inter), SILU_BLOCK)
        grid = (num_tokens, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](gate_up, out, inter, gate_up.stride(0), BLOCK=block, num_warps=4)
    return out


def triton_rope_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (HF rotate_half convention) on the q and k heads of ``qkv`` in one launch.

    Args:
        qkv: ``[num_tokens, num_heads + 2 * num_kv_heads, head_dim]`` (fp32/fp16/bf16), q heads then k then
            v; may be a strided view of the fused projection (``head_dim`` contiguous or it is copied).
        cos, sin: ``[num_tokens, head_dim]`` of ``qkv``'s dtype, both halves equal (only the first is read).
        num_heads, num_kv_heads: query and key/value heads.

    Returns:
        ``(q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim])``, new contiguous
        tensors. Same math as :func:`infinite_llm.core.model.apply_rope`; source: vLLM ``rotary_embedding``.

    Raises:
        InvalidRequest: bad shapes (odd ``head_dim``), dtypes or devices.
    """
    if qkv.dim() != 3 or qkv.shape[1] != num_heads + 2 * num_kv_heads or qkv.shape[2] % 2:
        raise InvalidRequest(
            f"qkv has shape {tuple(qkv.shape)}; expected [num_tokens, {num_heads} + 2 * {num_kv_heads}, even head_dim]"
        )
    num_tokens, _, head_dim = qkv.shape
    check_dtype("qkv", qkv, FLOAT_DTYPES)
    for name, table in (("cos", cos), ("sin", sin)):
        check_shape(name, table, (num_tokens, head_dim))
        check_dtype(name, table, (qkv.dtype,))
    check_device(_rope_qk_kernel, {"qkv": qkv, "cos": cos, "sin": sin})
    qkv = qkv if qkv.stride(2) == 1 else qkv.contiguous()
    cos, sin = _rows_contiguous(cos), _rows_contiguous(sin)
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q, k
    _rope_qk_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, q, k, num_heads, num_kv_heads, qkv.stride(0), qkv.stride(1), cos.stride(0), sin.stride(0),
        HALF=head_dim // 2, BLOCK_HALF=next_power_of_2(head_dim // 2), num_warps=1,
    )  # fmt: skip
    return q, k


def triton_write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Store new keys and values into their slots of one layer's paged pool, K and V in one launch.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place at flat slot
            ``block_id * block_size + offset``; may be views (one layer of ``[L, num_blocks, ...]``) as long
            as ``head_dim`` is contiguous.
        slot_mapping: ``[num_new_tokens]`` int32/int64; rows with a slot < 0 (padding) are skipped.
        key, value: ``[num_new_tokens, num_kv_heads, head_dim]`` float, cast to the cache dtype.

    Same contract as :func:`infinite_llm.core.attention.write_kv`; source: vLLM ``reshape_and_cache``.

    Raises:
        InvalidRequest: bad shapes, dtypes or devices, or caches whose ``head_dim`` is not contiguous.
    """
    if k_cache.dim() != 4:
        raise InvalidRequest(f"k_cache has shape {tuple(k_cache.shape)}; expected [num_blocks, block_size, Hkv, D]")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if slot_mapping.dim() != 1:
        raise InvalidRequest(f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected [num_new_tokens]")
    num_new = slot_mapping.shape[0]
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("key", key, (num_new, num_kv_heads, head_dim))
    check_shape("value", value, (num_new, num_kv_heads, head_dim))
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache), ("key", key), ("value", value)):
        check_dtype(name, tensor, FLOAT_DTYPES)
    tensors = {"k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping, "key": key, "value": value}
    check_device(_write_kv_kernel, tensors)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise InvalidRequest("k_cache and v_cache must have a contiguous head_dim (they are written in place)")
    if num_new == 0:
        return
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    kc, vc = k_cache.stride(), v_cache.stride()
    _write_kv_kernel[(num_new,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(), head_dim, num_kv_heads * head_dim, block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), kc[0], kc[1], kc[2], vc[0], vc[1], vc[2],
        BLOCK=next_power_of_2(num_kv_heads * head_dim), num_warps=4,
    )  # fmt: skip


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, cols]`` itself if its columns are contiguous (any row stride), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
