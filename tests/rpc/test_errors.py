"""Typed errors across real loopback gRPC: the exact class, param and message come back on the client side;
bytes that are not a request message are INVALID_ARGUMENT; a message over the size limit is
``MessageTooLarge`` (INVALID_ARGUMENT), never the retryable ``CapacityExhausted``."""

import grpc
import pytest

from infinite_llm.core import errors as E
from infinite_llm.core.errors import InfiniteLLMError, error_class
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.pb.v1 import attention_server_pb2_grpc as pb_grpc
from infinite_llm.rpc.errors import ERROR_PARAM_KEY, ERROR_REASON_KEY, error_from_rpc
from infinite_llm.rpc.interceptors import REQUEST_ID_KEY
from infinite_llm.rpc.server import Service, start_server

# Every class that crosses a process boundary, with a param to carry (None: the class has no param here).
CASES = [
    (E.InvalidRequest, "top_p"),
    (E.ContextLengthExceeded, "max_tokens"),
    (E.MessageTooLarge, "prompt"),
    (E.NotFound, None),
    (E.ModelNotFound, "model"),
    (E.CapacityExhausted, None),
    (E.QueueFull, None),
    (E.KVCapacityExceeded, "prompt"),
    (E.FailedPrecondition, None),
    (E.Unavailable, None),
    (E.KVMemoryLost, None),
    (E.DeadlineExceeded, None),
    (E.Cancelled, None),
    (E.InfiniteLLMError, None),
]


class RaisingServicer(pb_grpc.AttentionServerServicer):
    """``FreeSequence(seq_id=REASON)`` raises the class with that reason (param ``seq_id`` after a ``:``)."""

    async def FreeSequence(self, request, context):
        reason, _, param = request.seq_id.partition(":")
        if reason == "ok":
            return pb.FreeSequenceResponse(num_freed=3)
        raise error_class(reason)(f"raised as {reason} with ünïcödé", param=param or None)

    async def ImportBlocks(self, request_iterator, context):
        n = 0
        async for _ in request_iterator:
            n += 1
        return pb.ImportBlocksResponse(block_ids=[n])


@pytest.fixture(scope="module")
def port(loop):
    service = Service.of(pb, "AttentionServer", pb_grpc.add_AttentionServerServicer_to_server, RaisingServicer())
    rpc = loop.run(start_server([service]))
    yield rpc.port
    loop.run(rpc.stop(0))


@pytest.fixture
def stub(port):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield pb_grpc.AttentionServerStub(ch)


def _failure(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=10, **kwargs)
    return info.value


def test_every_reason_names_exactly_one_class():
    for cls, _ in CASES:
        assert error_class(cls.reason) is cls
    assert len({cls.reason for cls, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("cls,param", CASES, ids=[c.__name__ for c, _ in CASES])
def test_the_exact_class_param_and_message_cross_grpc(stub, cls, param):
    seq_id = f"{cls.reason}:{param}" if param else cls.reason
    e = _failure(stub.FreeSequence, pb.FreeSequenceRequest(seq_id=seq_id), metadata=[(REQUEST_ID_KEY, "rid-1")])
    assert e.code() == getattr(grpc.StatusCode, cls.grpc_code)
    trailers = dict(e.trailing_metadata())
    assert trailers[ERROR_REASON_KEY] == cls.reason
    assert trailers.get(ERROR_PARAM_KEY) == param
    assert trailers[REQUEST_ID_KEY] == "rid-1"  # the request id is still echoed beside the error
    err = error_from_rpc(e)
    assert type(err) is cls
    assert (err.param, err.message, err.http_status) == (param, f"raised as {cls.reason} with ünïcödé", cls.http_status)
    assert stub.FreeSequence(pb.FreeSequenceRequest(seq_id="ok"), timeout=10).num_freed == 3


def test_a_status_without_a_reason_maps_by_its_code():
    class Bare(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "from elsewhere"

        def trailing_metadata(self):
            return ()

    assert type(error_from_rpc(Bare(grpc.StatusCode.UNAVAILABLE))) is E.Unavailable
    assert type(error_from_rpc(Bare(grpc.StatusCode.NOT_FOUND))) is E.NotFound
    assert type(error_from_rpc(Bare(grpc.StatusCode.UNKNOWN))) is InfiniteLLMError
    # Only gRPC itself answers RESOURCE_EXHAUSTED without a reason: a message over the size limit.
    assert type(error_from_rpc(Bare(grpc.StatusCode.RESOURCE_EXHAUSTED))) is E.MessageTooLarge


def test_a_message_over_the_send_limit_is_message_too_large_not_capacity(port):
    options = [("grpc.max_send_message_length", 1024)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
        e = _failure(pb_grpc.AttentionServerStub(ch).FreeSequence, pb.FreeSequenceRequest(seq_id="x" * 4096))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # what gRPC says...
    err = error_from_rpc(e)
    assert type(err) is E.MessageTooLarge and err.grpc_code == "INVALID_ARGUMENT" and err.http_status == 400


@pytest.mark.parametrize(
    "method,streaming",
    [("/infinite_llm.v1.AttentionServer/FreeSequence", False), ("/infinite_llm.v1.AttentionServer/ImportBlocks", True)],
)
@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff", b"\x0a\x02\xff\xfe"], ids=["not-protobuf", "bad-utf8"])
def test_bytes_that_are_not_the_request_message_are_invalid_argument(stub, port, method, streaming, garbage):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        if streaming:
            call = ch.stream_unary(method)
            e = _failure(call, iter([garbage]))
        else:
            e = _failure(ch.unary_unary(method), garbage)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert dict(e.trailing_metadata())[ERROR_REASON_KEY] == "INVALID_REQUEST"
    assert "not a valid" in e.details()
    assert stub.FreeSequence(pb.FreeSequenceRequest(seq_id="ok"), timeout=10).num_freed == 3  # still serving
    assert stub.ImportBlocks(iter([pb.BlockTransferChunk()] * 2), timeout=10).block_ids == [2]
