"""The compiled paged-attention kernel on a CUDA GPU against the torch reference (skipped without CUDA).

The interpreted tests prove the algorithm; these prove what only a GPU can: that every launch shape the
policy (``launch_plan.py``) or a tuning sweep may pick compiles within the SM's registers and shared
memory, and that the policy's splits on the real SM count are exact. Shapes are the served ones: 32 query /
8 kv heads of 128 and of 64 (Llama-3.2-1B), block_size 16, fp32 (exact) and bf16.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from infinite_llm.core.attention import partial_attention
from infinite_llm.kernels import paged_attention
from infinite_llm.kernels.launch_plan import TileOverrides
from tests.kernels.test_paged_attention import Case, Part, build_case, shuffled

COMPILED_KERNELS = True  # conftest: do not interpret
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (out, lse) tolerances. bf16: the kernel feeds bf16 probabilities to the second matmul, as FlashAttention does.
TOLERANCE = {
    torch.float32: (dict(atol=1e-4, rtol=1e-4), dict(atol=1e-4, rtol=1e-4)),
    torch.bfloat16: (dict(atol=3e-2, rtol=3e-2), dict(atol=1e-2, rtol=1e-3)),
}


def on_cuda(case: Case) -> Case:
    fields = [f.name for f in dataclasses.fields(case.meta) if f.name != "cache"]  # cache: per-step memo
    meta = type(case.meta)(**{name: getattr(case.meta, name).cuda() for name in fields})
    return Case(case.query.cuda(), case.k_cache.cuda(), case.v_cache.cuda(), meta)


def long_batch(chunk: int) -> list[Part]:
    """Three sequences of 5000, 2000 and 300 tokens in shuffled blocks of 16; the first with a ``chunk``."""
    nb = lambda ctx: math.ceil(ctx / 16)  # noqa: E731
    return [
        Part(5000, list(range(5000 - chunk, 5000)), shuffled(list(range(nb(5000))), seed=1)),
        Part(2000, [1999], shuffled(list(range(0, nb(2000), 2)), seed=2)),  # every other block
        Part(300, [299], list(reversed(range(nb(300))))),
    ]


def check(case: Case, dtype: torch.dtype, **kwargs: object) -> None:
    out, lse = paged_attention.triton_partial_attention(case.query, case.k_cache, case.v_cache, case.meta, **kwargs)
    ref_out, ref_lse = partial_attention(case.query.float(), case.k_cache.float(), case.v_cache.float(), case.meta)
    out_tol, lse_tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref_out, **out_tol)
    torch.testing.assert_close(lse, ref_lse, **lse_tol)


def test_kernels_are_compiled_not_interpreted():
    assert not paged_attention.interpreting(paged_attention._paged_attention_kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("chunk", [1, 200])
def test_policy_launch_matches_reference_on_long_contexts(dtype, head_dim, chunk):
    case = build_case(long_batch(chunk), num_heads=32, num_kv_heads=8, head_dim=head_dim, block_size=16,
                      dtype=dtype, seed=head_dim + chunk)  # fmt: skip
    check(on_cuda(case), dtype)


SWEEP_TILES = [  # every shape kernels_gpu.py's sweep launches, and the policy's
    TileOverrides(block_n=32),
    TileOverrides(block_n=64),
    TileOverrides(block_n=128),
    TileOverrides(block_n=64, num_warps=8),
    TileOverrides(block_n=64, num_stages=2),
    TileOverrides(block_n=64, num_stages=4),
    TileOverrides(block_m=64, block_n=32, num_warps=4),
    TileOverrides(block_m=64, block_n=64, num_warps=4),
    TileOverrides(block_m=128, block_n=32, num_warps=8),
    TileOverrides(block_m=128, block_n=64, num_warps=8),
    TileOverrides(block_m=128, block_n=64, num_warps=4),
    TileOverrides(block_m=128, block_n=64, num_warps=8, num_stages=2),
]


@pytest.mark.parametrize("tiles", SWEEP_TILES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 7])
def test_every_swept_launch_shape_compiles_and_matches_reference(tiles, num_splits):
    case = build_case(long_batch(200), num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                      dtype=torch.bfloat16, seed=5)  # fmt: skip
    check(on_cuda(case), torch.bfloat16, num_splits=num_splits, tiles=tiles)
