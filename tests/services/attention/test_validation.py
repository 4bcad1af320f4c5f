"""The layer checks of an attention server without a server: finiteness in every KV dtype on the CPU (numpy;
bfloat16 by its bits), naming the first bad tensor."""

import math

import pytest
import torch

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.rmanager import KVLayout, RManager, SeqStep
from infinite_llm.services.attention.types import ServerStep
from infinite_llm.services.attention.validation import all_finite, check_layer

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_each_non_finite_value_in_each_tensor(dtype, bad):
    tensors = [torch.randn(5, NUM_HEADS, HEAD_DIM, dtype=dtype) for _ in range(3)]
    assert all_finite(tensors) == [True, True, True]
    for i in range(3):
        spoiled = [t.clone() for t in tensors]
        spoiled[i][4, NUM_HEADS - 1, HEAD_DIM - 1] = bad  # the last element: no early exit hides it
        assert all_finite(spoiled) == [j != i for j in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_extremes_of_each_dtype_are_finite(dtype):
    info = torch.finfo(dtype)
    extremes = torch.tensor([info.max, -info.max, info.tiny, info.smallest_normal / 4, 0.0, -0.0], dtype=dtype)
    assert all_finite([extremes]) == [True]


def test_all_finite_reads_read_only_views_of_received_bytes():
    """The codec hands the server ``frombuffer`` views of the message's bytes (read-only)."""
    good = torch.frombuffer(bytearray(torch.ones(6).numpy().tobytes()), dtype=torch.float32)
    data = torch.ones(6)
    data[2] = math.nan
    bad = torch.frombuffer(data.numpy().tobytes(), dtype=torch.float32)  # bytes: read-only
    assert all_finite([good, bad]) == [True, False]
    bf16 = torch.frombuffer(data.bfloat16().view(torch.int16).numpy().tobytes(), dtype=torch.bfloat16)
    assert all_finite([bf16, torch.ones(3, dtype=torch.bfloat16)]) == [False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("field", ["query", "key", "value"])
def test_check_layer_names_the_tensor_that_holds_nan(dtype, field):
    layout = KVLayout(num_layers=1, block_size=4, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=dtype)
    rm = RManager(4, layout)
    rm.commit(rm.reserve("a", 1).reservation_id, [0])
    step = ServerStep(rm.plan_step([SeqStep("a", 0, 3)]), NUM_HEADS)
    tensors = {
        "query": torch.randn(3, NUM_HEADS, HEAD_DIM, dtype=dtype),
        "key": torch.randn(3, NUM_KV_HEADS, HEAD_DIM, dtype=dtype),
        "value": torch.randn(3, NUM_KV_HEADS, HEAD_DIM, dtype=dtype),
    }
    check_layer(step, *tensors.values(), layout)  # finite: passes
    tensors[field][1, 0, 0] = math.nan
    with pytest.raises(InvalidRequest, match=f"^{field} holds NaN or infinite values$"):
        check_layer(step, *tensors.values(), layout)
