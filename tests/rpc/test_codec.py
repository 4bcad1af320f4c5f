"""Tensor codec: exact round trips for every wire dtype, zero-copy decode, validation, and chunking."""

import ctypes

import pytest
import torch

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.pb.v1 import tensor_pb2
from infinite_llm.rpc import codec


def _sample(dtype: torch.dtype, shape=(3, 4, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g).to(dtype)


def _address(buffer: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(buffer), ctypes.c_void_p).value


@pytest.mark.parametrize("dtype", list(codec.DTYPES.values()), ids=list(codec.DTYPES))
def test_every_wire_dtype_round_trips_bit_exactly(dtype):
    t = _sample(dtype)
    msg = tensor_pb2.Tensor.FromString(codec.encode_tensor(t).SerializeToString())
    assert msg.dtype == codec.dtype_name(dtype) and list(msg.shape) == [3, 4, 5]
    assert len(msg.data) == t.numel() * t.element_size()
    back = codec.decode_tensor(msg)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))  # bits, so NaN-safe and bf16-exact


def test_bfloat16_bytes_are_the_raw_little_endian_bits():
    t = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    assert codec.encode_tensor(t).data == bytes.fromhex("803f00c0003f")


def test_non_contiguous_and_scalar_and_empty_tensors_round_trip():
    base = _sample(torch.float32, (4, 6, 8))
    for t in (base.transpose(0, 2), base[:, ::2, 1:7:3], base[1, 2, 3], base[:0]):
        back = codec.decode_tensor(codec.encode_tensor(t))
        assert back.shape == t.shape and torch.equal(back, t)
        assert back.is_contiguous()


def test_decode_is_zero_copy_over_the_received_bytes():
    t = _sample(torch.float16, (8, 2, 16))
    msg = codec.encode_tensor(t)
    data = msg.data  # one reference to the received bytes
    view = codec.tensor_from_buffer(msg.dtype, msg.shape, data)
    assert view.data_ptr() == _address(data)
    assert torch.equal(view, t)


def test_decoding_a_bytearray_gives_a_writable_view_of_it():
    buf = bytearray(codec.tensor_to_bytes(torch.arange(6, dtype=torch.int32)))
    view = codec.tensor_from_buffer("int32", [2, 3], buf)
    view[1, 2] = 42
    assert codec.tensor_from_buffer("int32", [6], buf)[5] == 42


@pytest.mark.parametrize(
    ("msg", "fragment"),
    [
        (tensor_pb2.Tensor(dtype="float64", shape=[1], data=b"\0" * 8), "unknown dtype 'float64'"),
        (tensor_pb2.Tensor(dtype="", shape=[1], data=b"\0" * 4), "unknown dtype ''"),
        (tensor_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"\0" * 20), "20 data bytes do not match"),
        (tensor_pb2.Tensor(dtype="int64", shape=[-1, 2], data=b""), "negative dimension"),
        (tensor_pb2.Tensor(dtype="bfloat16", shape=[], data=b"\0"), "1 data bytes do not match"),
    ],
)
def test_malformed_tensors_are_invalid_requests_naming_the_field(msg, fragment):
    with pytest.raises(InvalidRequest, match="query") as info:
        codec.decode_tensor(msg, field="query")
    assert fragment in info.value.message


def test_a_dtype_without_a_wire_name_cannot_be_encoded():
    with pytest.raises(InvalidRequest, match="float64"):
        codec.encode_tensor(torch.zeros(2, dtype=torch.float64))


def test_payload_is_split_into_one_mib_chunks_and_reassembled():
    data = bytes(range(256)) * (10 * 1024)  # 2.5 MiB
    chunks = list(codec.split_chunks(data))
    assert [len(c) for c in chunks] == [1 << 20, 1 << 20, len(data) - (2 << 20)]
    assert bytes(codec.join_chunks(chunks, len(data))) == data
    assert list(codec.split_chunks(b"")) == []
    assert codec.join_chunks([], 0) == bytearray()


def test_reassembly_refuses_short_and_long_payloads():
    chunks = list(codec.split_chunks(b"x" * 10, chunk_bytes=4))
    assert [len(c) for c in chunks] == [4, 4, 2]
    with pytest.raises(InvalidRequest, match="ended after 8 of 10 bytes"):
        codec.join_chunks(chunks[:2], 10)
    with pytest.raises(InvalidRequest, match="overflows its declared size of 9 bytes"):
        codec.join_chunks(chunks, 9)
    with pytest.raises(InvalidRequest, match="chunk_bytes must be positive"):
        list(codec.split_chunks(b"x", chunk_bytes=0))


def test_payload_size_follows_dtype_and_shape():
    assert codec.payload_nbytes(codec.tensor_meta(torch.bfloat16, [2, 3, 4])) == 48
    with pytest.raises(InvalidRequest, match="negative"):
        codec.payload_nbytes(tensor_pb2.Tensor(dtype="float32", shape=[2, -3]))
