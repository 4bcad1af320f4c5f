"""Fixtures: a background event loop and a factory of real attention servers on 127.0.0.1 (port 0)."""

import warnings

import pytest

from infinite_llm.pb.v1 import attention_server_pb2_grpc as pb_grpc
from infinite_llm.rpc.channels import sync_channel
from infinite_llm.services.attention import AttentionServerConfig, start
from tests.rpc.loop_thread import LoopThread


@pytest.fixture(autouse=True)
def _zero_copy_decode_is_intended():
    """pytest resets warning filters per test; the codec's read-only ``frombuffer`` views are on purpose."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def make_server(loop):
    """``make_server(num_blocks, layout, server_id, transport)`` -> (server, stub); every server and channel
    closes at teardown."""
    started, channels = [], []

    def make(num_blocks, layout, server_id="attn-0", transport="grpc"):
        config = AttentionServerConfig(
            server_id=server_id,
            kv_memory_bytes=num_blocks * layout.bytes_per_block,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=str(layout.dtype).removeprefix("torch."),
            block_size=layout.block_size,
            transport=transport,
        )
        server = loop.run(start(config))
        started.append(server)
        channel = sync_channel(server.address)
        channels.append(channel)
        return server, pb_grpc.AttentionServerStub(channel)

    yield make
    for channel in channels:
        channel.close()
    for server in started:
        loop.run(server.stop(0))


@pytest.fixture
def make_pair(make_server):
    """``make_pair(num_blocks, layout, server_id, mirrored=True, transport="grpc")`` -> a real server and its
    local mirror."""
    from tests.services.attention.helpers import Pair

    def make(num_blocks, layout, server_id="attn-0", mirrored=True, transport="grpc"):
        server, stub = make_server(num_blocks, layout, server_id, transport)
        return Pair(stub, num_blocks, layout, mirrored=mirrored, address=server.address)

    return make
