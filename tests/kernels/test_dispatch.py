"""``infinite_llm.kernels`` picks torch on CPU, Triton on CUDA or when forced; launchers refuse CPU unless
interpreted."""

from __future__ import annotations

import pytest
import torch

from infinite_llm import kernels
from infinite_llm.core import attention as reference
from infinite_llm.core.attention import PartialAttentionMetadata
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.kernels._checks import check_device


def small_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PartialAttentionMetadata]:
    """One sequence of 6 tokens in blocks 2, 0 of the pool (block_size 4), decoding at position 5."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 3, 4, 1, 16, generator=gen)
    meta = PartialAttentionMetadata(
        torch.tensor([0, 1]), torch.tensor([5]), torch.tensor([[2, 0]]), torch.tensor([[0, 1]]),
        torch.tensor([2]), torch.tensor([6]),
    )  # fmt: skip
    return torch.randn(1, 2, 16, generator=gen), k_cache, v_cache, meta


def _fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("the Triton launcher must not be called")


def test_cpu_tensors_use_the_torch_reference_by_default(monkeypatch):
    monkeypatch.delenv(kernels.ENV_FORCE, raising=False)
    monkeypatch.setattr("infinite_llm.kernels.paged_attention.triton_partial_attention", _fail)
    monkeypatch.setattr("infinite_llm.kernels.merge.triton_merge_partials", _fail)
    query, k_cache, v_cache, meta = small_case()
    assert not kernels.use_triton(torch.device("cpu"))
    out, lse = kernels.partial_attention(query, k_cache, v_cache, meta)
    ref_out, ref_lse = reference.partial_attention(query, k_cache, v_cache, meta)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    merged = kernels.merge_partials([out, out], [lse, lse])
    assert torch.equal(merged[0], reference.merge_partials([out, out], [lse, lse])[0])


def test_cuda_tensors_use_triton_unless_forced_off(monkeypatch):
    monkeypatch.delenv(kernels.ENV_FORCE, raising=False)
    assert kernels.use_triton(torch.device("cuda"))
    monkeypatch.setenv(kernels.ENV_FORCE, "0")
    assert not kernels.use_triton(torch.device("cuda"))


def test_env_override_forces_triton_on_cpu(monkeypatch):
    monkeypatch.setenv(kernels.ENV_FORCE, "1")
    calls = []
    from infinite_llm.kernels import paged_attention

    launcher = paged_attention.triton_partial_attention
    counted = lambda *a, **kw: calls.append(1) or launcher(*a, **kw)  # noqa: E731
    monkeypatch.setattr(paged_attention, "triton_partial_attention", counted)
    query, k_cache, v_cache, meta = small_case()
    out, lse = kernels.partial_attention(query, k_cache, v_cache, meta)
    ref_out, ref_lse = reference.partial_attention(query, k_cache, v_cache, meta)
    assert calls == [1]
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    merged_out, merged_lse = kernels.merge_partials(torch.stack([out, out]), torch.stack([lse, lse]))
    torch.testing.assert_close(merged_out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse + torch.log(torch.tensor(2.0)), atol=1e-5, rtol=1e-5)


def test_compiled_kernels_refuse_cpu_tensors():
    compiled_kernel = object()  # anything but an InterpretedFunction
    with pytest.raises(InvalidRequest, match="Triton kernels need CUDA tensors \\(got cpu\\)"):
        check_device(compiled_kernel, {"query": torch.zeros(1)})


def test_tensors_on_different_devices_are_refused():
    with pytest.raises(InvalidRequest, match="k_cache is on meta, query on cpu"):
        check_device(object(), {"query": torch.zeros(1), "k_cache": torch.zeros(1, device="meta")})
