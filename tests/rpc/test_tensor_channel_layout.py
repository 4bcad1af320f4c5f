"""The byte layouts of tensor-channel buffers (``rpc/tensor_channel.py``): what ``pack`` writes, the step's
fields read back; a step's reply buffer carries each layer's partial and refuses a partial of another shape."""

import pytest
import torch

from infinite_llm.rpc import tensor_channel as tc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_packed_layer_unpacks_to_the_same_query_key_value(dtype):
    sizes = tc.step_sizes(5, 9, 3, 3, 64, dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((5, 9, 64), (3, 3, 64), (3, 3, 64)))
    buffer = tc.pack([q, k, v], torch.device("cpu"))
    assert buffer.numel() == sizes.layer_nbytes
    got = tc.unpack(buffer, sizes.layer_fields)
    assert [t.dtype for t in got] == [dtype] * 3
    assert all(torch.equal(a, b) for a, b in zip(got, (q, k, v), strict=True))


def test_a_step_reply_buffer_carries_each_layers_partial_after_an_ok_status():
    sizes = tc.step_sizes(4, 2, 1, 1, 8, torch.bfloat16)
    reply = tc.ReplyBuffer(sizes, torch.device("cpu"))
    for seed in range(2):  # reused: the second layer's bytes replace the first's
        g = torch.Generator().manual_seed(seed)
        lse, out = torch.randn(4, 2, generator=g), torch.randn(4, 2, 8, generator=g).to(torch.bfloat16)
        buffer = reply.fill(lse, out)
        assert buffer.numel() == sizes.reply_nbytes and tc.reply_status(buffer) == tc.LAYER_OK
        got_lse, got_out = tc.unpack(buffer.clone(), sizes.reply_fields)
        assert torch.equal(got_lse, lse) and torch.equal(got_out, out)


def test_a_partial_of_another_shape_is_refused_not_broadcast():
    reply = tc.ReplyBuffer(tc.step_sizes(4, 2, 1, 1, 8, torch.float32), torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit"):
        reply.fill(torch.zeros(1, 2), torch.zeros(1, 2, 8))  # would broadcast over the 4 rows


def test_a_failed_reply_is_the_failed_status_then_zeros():
    buffer = tc.failed_reply(40, torch.device("cpu"))
    assert tc.reply_status(buffer) == tc.LAYER_FAILED and not buffer[tc.STATUS_BYTES :].any()
