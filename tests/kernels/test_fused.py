"""Fused Triton kernels (interpreted, on CPU) against their torch references in core/model.py and core/attention.py.

Tolerances, and why: the residual add and the K/V copy are exact. Each norm or silu output may differ in its
last bit in fp32 (the kernel's fp32 sum runs in another order than torch's, and ``exp``/``rsqrt`` are other
implementations). In bf16 the interpreter rounds fp32 -> bf16 by truncation, not to nearest even as torch and
the GPU do, and runs ``tl.fma`` as a rounded product then a sum: so bf16 results are checked to a bf16 ulp or
two here, fp32 RoPE to an fp32 ulp, and ``test_fused_cuda.py`` checks exactness where the GPU gives it.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from infinite_llm import kernels
from infinite_llm.core import model as dense
from infinite_llm.core.attention import write_kv
from infinite_llm.core.config import ModelConfig
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.kernels._checks import interpreting

FUSED_MODULE = "infinite_llm.kernels.fused"
# (rtol, atol) by dtype for outputs that go through exp, rsqrt or a reduction (see the module docstring)
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2**-6, atol=1e-5)}
DTYPES = [torch.float32, torch.bfloat16]


@contextlib.contextmanager
def fresh_fused_module() -> Iterator[ModuleType]:
    """``infinite_llm.kernels.fused`` imported afresh, so that its ``@triton.jit`` kernels follow
    ``TRITON_INTERPRET`` as set now (triton reads it when a kernel is defined, and conftest re-imports only the
    modules it lists); forgotten on exit, so that its next importer (the dispatchers import it when called)
    defines it under the setting conftest then restores."""
    sys.modules.pop(FUSED_MODULE, None)
    yield importlib.import_module(FUSED_MODULE)
    sys.modules.pop(FUSED_MODULE, None)


@pytest.fixture(scope="module")
def fused(triton_interpreter: None) -> Iterator[ModuleType]:
    """The kernels module, interpreted (conftest's ``triton_interpreter`` sets ``TRITON_INTERPRET=1``)."""
    with fresh_fused_module() as module:
        yield module


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [num_tokens, head_dim]`` of positions 0, 3, 6, ... (both halves equal, as the model's)."""
    inv_freq = dense.rope_inv_freq(head_dim, 10000.0, None)
    freqs = (torch.arange(num_tokens) * 3).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def test_kernels_run_in_the_interpreter(fused):
    kernels_ = (fused._rms_norm_kernel, fused._silu_and_mul_kernel, fused._rope_qk_kernel, fused._write_kv_kernel)
    assert all(interpreting(k) for k in kernels_)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("hidden", [96, 576])
def test_rms_norm_matches_hf_llama_rms_norm(fused, dtype, num_tokens, hidden):
    x = randn(num_tokens, hidden, dtype=dtype, seed=hidden + num_tokens, scale=3.0)
    weight = randn(hidden, dtype=dtype, seed=1)
    out = fused.triton_rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, dense.rms_norm(x, weight, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("hidden", [96, 576])
def test_fused_add_rms_norm_matches_add_then_norm(fused, dtype, num_tokens, hidden):
    x = randn(num_tokens, hidden, dtype=dtype, seed=hidden + num_tokens)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=7, scale=4.0)
    weight = randn(hidden, dtype=dtype, seed=2)
    before = residual.clone()
    normed, new_residual = fused.triton_fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_residual = dense.fused_add_rms_norm(x, residual, weight, 1e-6)[1]
    assert torch.equal(residual, before), "out of place: the caller's residual is not written"
    if dtype == torch.float32:
        assert torch.equal(new_residual, ref_residual)
    else:  # the interpreter truncates the fp32 sum to bf16 instead of rounding it: one ulp
        torch.testing.assert_close(new_residual, ref_residual, rtol=2**-7, atol=0)
    # the norm of the sum the kernel made (in bf16 here that sum may be one ulp off, see above)
    torch.testing.assert_close(normed, dense.rms_norm(new_residual, weight, 1e-6), **TOL[dtype])


def test_rms_norm_reads_rows_of_a_strided_view(fused):
    x = randn(5, 2, 96, dtype=torch.float32, seed=3)[:, 1]  # (T, hidden), row stride 192
    weight = randn(96, dtype=torch.float32, seed=4)
    torch.testing.assert_close(fused.triton_rms_norm(x, weight, 1e-6), dense.rms_norm(x, weight, 1e-6), **TOL[x.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("intermediate", [96, 1500])  # 1500 > SILU_BLOCK: two column tiles, the last partial
def test_silu_and_mul_matches_torch(fused, dtype, num_tokens, intermediate):
    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=intermediate, scale=3.0)
    out = fused.triton_silu_and_mul(gate_up)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    torch.testing.assert_close(out, dense.silu_and_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 2, 96)])  # (num_heads, num_kv_heads, head_dim)
def test_rope_qk_on_the_fused_projection_matches_apply_rope(fused, dtype, num_tokens, heads):
    num_heads, num_kv_heads, head_dim = heads
    # the fused projection's output viewed as heads: q, k and v heads side by side, q/k a strided part of it
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=num_tokens)
    qkv = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    cos, sin = rope_tables(num_tokens, head_dim, dtype)
    q, k = fused.triton_rope_qk(qkv, cos, sin, num_heads, num_kv_heads)
    ref_q, ref_k = dense.rope_qk(qkv, cos, sin, num_heads, num_kv_heads)
    assert q.is_contiguous() and k.is_contiguous()
    # fp32: torch's addcmul_ is one fused multiply-add, the interpreter's tl.fma a rounded product then a sum.
    # bf16: the truncated first product is off by up to an ulp of |x1*c| <= 4, which the sum may cancel.
    tol = dict(rtol=2e-7, atol=2e-7) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-5)
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)


def test_rope_qk_copies_a_qkv_whose_head_dim_is_strided(fused):
    qkv = randn(3, 16, 8, dtype=torch.float32, seed=5).transpose(1, 2)  # (T, 8 heads, D 16), stride(2) = 8
    cos, sin = rope_tables(3, 16, torch.float32)
    q, k = fused.triton_rope_qk(qkv, cos, sin, 4, 2)
    ref_q, ref_k = dense.rope_qk(qkv, cos, sin, 4, 2)
    torch.testing.assert_close(q, ref_q, rtol=2e-7, atol=2e-7)
    torch.testing.assert_close(k, ref_k, rtol=2e-7, atol=2e-7)


def layer_caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[L=3, num_blocks=4, block_size=4, Hkv=2, D=24]`` K and V pools (NaN-free random) and layer 1 of each."""
    k_pool = randn(3, 4, 4, 2, 24, dtype=dtype, seed=10)
    v_pool = randn(3, 4, 4, 2, 24, dtype=dtype, seed=11)
    return k_pool, v_pool, k_pool[1], v_pool[1]


@pytest.mark.parametrize("key_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_write_kv_writes_a_layer_view_and_skips_negative_slots(fused, key_dtype, cache_dtype):
    k_pool, v_pool, k_cache, v_cache = layer_caches(cache_dtype)
    slots = torch.tensor([5, -1, 14, 0, -1, 9])  # block 1 offset 1, padding, block 3 offset 2, ...
    # value as a strided view (the v heads of a fused projection), key contiguous (the output of rope_qk)
    key = randn(6, 2, 24, dtype=key_dtype, seed=12)
    value = randn(6, 5, 24, dtype=key_dtype, seed=13)[:, 3:]
    ref_k_pool, ref_v_pool = k_pool.clone(), v_pool.clone()
    write_kv(ref_k_pool[1], ref_v_pool[1], slots, key, value)
    fused.triton_write_kv(k_cache, v_cache, slots, key, value)
    if (key_dtype, cache_dtype) == (torch.float32, torch.bfloat16):  # the interpreter truncates fp32 -> bf16
        torch.testing.assert_close(k_pool, ref_k_pool, rtol=2**-7, atol=0)
        torch.testing.assert_close(v_pool, ref_v_pool, rtol=2**-7, atol=0)
    else:
        assert torch.equal(k_pool, ref_k_pool) and torch.equal(v_pool, ref_v_pool)
    written = torch.tensor([5, 14, 0, 9])
    untouched = torch.tensor([s for s in range(16) if s not in written.tolist()])
    fresh_k, fresh_v, _, _ = layer_caches(cache_dtype)  # what every slot held before
    assert torch.equal(k_pool.view(3, 16, 2, 24)[1, untouched], fresh_k.view(3, 16, 2, 24)[1, untouched])
    assert torch.equal(k_pool[[0, 2]], fresh_k[[0, 2]]) and torch.equal(v_pool[[0, 2]], fresh_v[[0, 2]])
    new_rows = k_pool.view(3, 16, 2, 24)[1, written]
    torch.testing.assert_close(new_rows, key[[0, 2, 3, 5]].to(cache_dtype), rtol=2**-7, atol=0)


def test_write_kv_reference_with_only_padding_slots_writes_nothing():
    k_pool, v_pool, k_cache, v_cache = layer_caches(torch.float32)
    before = k_pool.clone(), v_pool.clone()
    write_kv(k_cache, v_cache, torch.tensor([-1, -1]), torch.ones(2, 2, 24), torch.ones(2, 2, 24))
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])


def test_write_kv_with_int32_slots_and_no_tokens(fused):
    k_pool, v_pool, k_cache, v_cache = layer_caches(torch.float32)
    before, ones = k_pool.clone(), torch.ones(1, 2, 24)
    fused.triton_write_kv(k_cache, v_cache, torch.zeros(0, dtype=torch.int32), ones[:0], ones[:0])
    assert torch.equal(k_pool, before)
    fused.triton_write_kv(k_cache, v_cache, torch.tensor([3], dtype=torch.int32), ones, ones)
    assert torch.equal(k_cache[0, 3], torch.ones(2, 24)) and torch.equal(v_cache[0, 3], torch.ones(2, 24))


def test_launchers_refuse_bad_shapes_and_dtypes(fused):
    x = torch.zeros(3, 96)
    with pytest.raises(InvalidRequest, match=r"weight has shape \(95,\); expected \(96,\)"):
        fused.triton_rms_norm(x, torch.ones(95), 1e-6)
    with pytest.raises(InvalidRequest, match="residual has dtype torch.bfloat16"):
        fused.triton_fused_add_rms_norm(x, x.bfloat16(), torch.ones(96), 1e-6)
    with pytest.raises(InvalidRequest, match="expected \\[num_tokens, 2 \\* intermediate\\]"):
        fused.triton_silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(InvalidRequest, match="qkv has shape \\(3, 7, 16\\)"):
        fused.triton_rope_qk(torch.zeros(3, 7, 16), torch.zeros(3, 16), torch.zeros(3, 16), 4, 2)
    with pytest.raises(InvalidRequest, match="key has shape \\(2, 2, 24\\); expected \\(3, 2, 24\\)"):
        _, _, k_cache, v_cache = layer_caches(torch.float32)
        fused.triton_write_kv(k_cache, v_cache, torch.arange(3), torch.zeros(2, 2, 24), torch.zeros(3, 2, 24))


def _fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("the Triton launcher must not be called")


def test_dense_ops_run_torch_on_cpu_and_triton_when_forced(fused, monkeypatch):
    x, weight = randn(3, 96, dtype=torch.float32, seed=20), randn(96, dtype=torch.float32, seed=21)
    monkeypatch.delenv(kernels.ENV_FORCE, raising=False)
    monkeypatch.setattr(fused, "triton_rms_norm", _fail)
    assert torch.equal(kernels.DENSE_OPS.rms_norm(x, weight, 1e-6), dense.rms_norm(x, weight, 1e-6))
    monkeypatch.setenv(kernels.ENV_FORCE, "1")
    monkeypatch.setattr(fused, "triton_rms_norm", lambda *args: "triton")
    assert kernels.DENSE_OPS.rms_norm(x, weight, 1e-6) == "triton"


def tiny_config() -> ModelConfig:
    """Two layers, hidden 96 (not a power of two), 4 query / 2 kv heads of 24, intermediate 160."""
    return ModelConfig(
        vocab_size=64, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, head_dim=24, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=False, attention_bias=True, bos_token_id=1, eos_token_ids=(2,),
        architecture="LlamaForCausalLM",
    )  # fmt: skip


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The step's tokens as one sequence at positions 0..T-1: ``q [T, H, D]`` -> ``[T, H, D]``."""
    g = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1) for t in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)


def test_model_with_triton_ops_matches_the_torch_ops(fused, monkeypatch):
    monkeypatch.setenv(kernels.ENV_FORCE, "1")
    torch.manual_seed(0)
    triton_model = dense.LlamaForCausalLM(tiny_config())  # default ops: the dispatchers, forced to Triton
    for p in triton_model.parameters():
        p.data.normal_(0, 0.3)
    torch_model = dense.LlamaForCausalLM(tiny_config(), ops=dense.TORCH_OPS)
    torch_model.load_state_dict(triton_model.state_dict())
    ids, positions, rows = torch.tensor([3, 60, 7, 1, 30]), torch.arange(5), torch.tensor([1, 4])
    calls = []
    monkeypatch.setattr(fused, "triton_silu_and_mul", lambda g, f=fused.triton_silu_and_mul: calls.append(1) or f(g))
    logits = triton_model(ids, positions, causal_attention, rows)
    assert len(calls) == 2, "the model went through the dispatchers to the Triton kernels"
    torch.testing.assert_close(logits, torch_model(ids, positions, causal_attention, rows), rtol=1e-5, atol=1e-5)
