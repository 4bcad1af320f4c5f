"""The compiled fused kernels on a CUDA GPU against the CPU torch references (skipped without CUDA).

The references run on CPU, where the held greedy references come from. On the GPU the kernel rounds as torch
does (fp32 -> bf16 to nearest even, ``tl.fma`` fused), so the residual add, RoPE and the K/V copy are checked
bit for bit; the norm and silu to a few fp32 ulps (sum order, ``exp``/``rsqrt``) and, in bf16, to one bf16
ulp on a small fraction of elements, where that fp32 difference crosses a rounding boundary. Also: the ops
replay correctly from a captured CUDA graph (they never sync), and the model's logits on Triton ops match.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from infinite_llm import kernels
from infinite_llm.core import model as dense
from infinite_llm.core.attention import write_kv
from infinite_llm.kernels._checks import interpreting
from tests.kernels.test_fused import (
    causal_attention,
    fresh_fused_module,
    layer_caches,
    randn,
    rope_tables,
    tiny_config,
)

COMPILED_KERNELS = True  # conftest: do not interpret
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}
MOSTLY_EXACT = {torch.float32: 0.0, torch.bfloat16: 0.98}  # fraction of elements equal to the bit (bf16)


@pytest.fixture(scope="module")
def fused(triton_interpreter: None) -> Iterator[ModuleType]:
    """The kernels module, compiled (conftest's ``triton_interpreter`` unsets ``TRITON_INTERPRET`` here)."""
    with fresh_fused_module() as module:
        yield module


def check_near(out: torch.Tensor, ref: torch.Tensor) -> None:
    """``out`` (CUDA) within :data:`TOL` of ``ref`` (CPU), and at least :data:`MOSTLY_EXACT` of it exact."""
    out = out.cpu()
    torch.testing.assert_close(out, ref, **TOL[ref.dtype])
    exact = (out == ref).float().mean().item()
    assert exact >= MOSTLY_EXACT[ref.dtype], f"only {exact:.3f} of the elements are exact"


def test_kernels_are_compiled_not_interpreted(fused):
    assert not interpreting(fused._rms_norm_kernel) and not interpreting(fused._write_kv_kernel)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 256])
@pytest.mark.parametrize("hidden", [96, 576, 2048, 4096])
def test_fused_add_rms_norm(fused, dtype, num_tokens, hidden):
    x = randn(num_tokens, hidden, dtype=dtype, seed=hidden + num_tokens)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=7, scale=4.0)
    weight = randn(hidden, dtype=dtype, seed=2)
    normed, new_residual = fused.triton_fused_add_rms_norm(x.cuda(), residual.cuda(), weight.cuda(), 1e-5)
    ref_normed, ref_residual = dense.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual.cpu(), ref_residual)
    check_near(normed, ref_normed)
    check_near(fused.triton_rms_norm(x.cuda(), weight.cuda(), 1e-5), dense.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 256])
@pytest.mark.parametrize("intermediate", [96, 1500, 8192])
def test_silu_and_mul(fused, dtype, num_tokens, intermediate):
    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=intermediate, scale=3.0)
    check_near(fused.triton_silu_and_mul(gate_up.cuda()), dense.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 256])
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 2, 96), (32, 8, 64), (32, 8, 128)])
def test_rope_qk_is_bit_exact(fused, dtype, num_tokens, heads):
    num_heads, num_kv_heads, head_dim = heads
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=num_tokens)
    qkv = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    cos, sin = rope_tables(num_tokens, head_dim, dtype)
    q, k = fused.triton_rope_qk(qkv.cuda(), cos.cuda(), sin.cuda(), num_heads, num_kv_heads)
    ref_q, ref_k = dense.rope_qk(qkv, cos, sin, num_heads, num_kv_heads)
    assert torch.equal(q.cpu(), ref_q) and torch.equal(k.cpu(), ref_k)


@pytest.mark.parametrize("key_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_write_kv_is_exact_and_skips_negative_slots(fused, key_dtype, cache_dtype):
    k_pool, v_pool, _, _ = layer_caches(cache_dtype)
    slots = torch.tensor([5, -1, 14, 0, -1, 9])
    key = randn(6, 2, 24, dtype=key_dtype, seed=12)
    value = randn(6, 5, 24, dtype=key_dtype, seed=13)[:, 3:]
    ref_k_pool, ref_v_pool = k_pool.clone(), v_pool.clone()
    write_kv(ref_k_pool[1], ref_v_pool[1], slots, key, value)
    k_pool, v_pool = k_pool.cuda(), v_pool.cuda()
    fused.triton_write_kv(k_pool[1], v_pool[1], slots.cuda(), key.cuda(), value.cuda())
    assert torch.equal(k_pool.cpu(), ref_k_pool) and torch.equal(v_pool.cpu(), ref_v_pool)


def test_ops_replay_from_a_cuda_graph(fused):
    """Captured once, replayed on new inputs copied into the same buffers: no host sync, no stale shapes."""
    t, hidden, heads, head_dim = 4, 576, (4, 2), 64
    x, residual = (randn(t, hidden, dtype=torch.bfloat16, seed=s).cuda() for s in (1, 2))
    weight = randn(hidden, dtype=torch.bfloat16, seed=3).cuda()
    gate_up = randn(t, 2 * 96, dtype=torch.bfloat16, seed=4).cuda()
    qkv = randn(t, 8, head_dim, dtype=torch.bfloat16, seed=5).cuda()
    cos, sin = (table.cuda() for table in rope_tables(t, head_dim, torch.bfloat16))
    k_pool, v_pool, _, _ = layer_caches(torch.bfloat16)
    k_pool, v_pool = k_pool.cuda(), v_pool.cuda()
    slots = torch.tensor([3, -1, 7, 12]).cuda()
    kv = randn(t, 2, 24, dtype=torch.bfloat16, seed=6).cuda()

    def step() -> tuple[torch.Tensor, ...]:
        normed, new_residual = fused.triton_fused_add_rms_norm(x, residual, weight, 1e-6)
        q, k = fused.triton_rope_qk(qkv, cos, sin, *heads)
        fused.triton_write_kv(k_pool[1], v_pool[1], slots, kv, kv)
        return normed, new_residual, fused.triton_silu_and_mul(gate_up), q, k

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for buffer, seed in ((x, 11), (residual, 12), (gate_up, 13), (qkv, 14), (kv, 15)):
        buffer.copy_(randn(*buffer.shape, dtype=buffer.dtype, seed=seed).cuda())
    slots.copy_(torch.tensor([-1, 9, 2, -1]))
    expected_pool = k_pool.clone()
    expected_pool.view(3, 16, 2, 24)[1, [9, 2]] = kv[[1, 2]]
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for replayed, direct in zip(outs, eager, strict=True):
        assert torch.equal(replayed, direct)
    assert torch.equal(k_pool, expected_pool)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_logits_on_triton_ops_match_torch_ops(fused, dtype, monkeypatch):
    monkeypatch.delenv(kernels.ENV_FORCE, raising=False)
    torch.manual_seed(0)
    model = dense.LlamaForCausalLM(tiny_config())
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    model = model.to(device="cuda", dtype=dtype)
    torch_model = dense.LlamaForCausalLM(tiny_config(), ops=dense.TORCH_OPS).to(device="cuda", dtype=dtype)
    torch_model.load_state_dict(model.state_dict())
    ids, rows = torch.tensor([3, 60, 7, 1, 30], device="cuda"), torch.tensor([1, 4], device="cuda")
    positions = torch.arange(5, device="cuda")
    logits = model(ids, positions, causal_attention, rows)
    expected = torch_model(ids, positions, causal_attention, rows)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(logits, expected, **tol)
