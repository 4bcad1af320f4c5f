"""The compute side of the data plane without a mesh: exact per-server step plans, layer messages that do not
grow with the context, and greedy output over real attention servers (gRPC on loopback) identical to the
in-process engine, with prompt lengths around block and server boundaries."""

import pytest
import torch

from infinite_llm.core.dist_attention import BlockRef, DistAttention, HolderId
from infinite_llm.core.local_transport import LocalPlacement, LocalTransport
from infinite_llm.core.rmanager import KVLayout, RManager, SeqStep
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.pb.v1 import attention_server_pb2 as pb
from infinite_llm.services.compute.grpc_transport import GrpcTransport
from tests.services.attention.helpers import TablePlacement

A, B, C = HolderId("A"), HolderId("B"), HolderId("C")


class RecordingTransport(LocalTransport):
    def __init__(self, holders) -> None:  # noqa: ANN001
        super().__init__(holders)
        self.opened: list[dict[HolderId, list[SeqStep]]] = []
        self.kv_rows: list[dict[HolderId, int]] = []  # K/V rows per holder announced at each open
        self.inputs: list[dict[HolderId, tuple[int, int, int]]] = []  # rows of q, k, v per holder per layer

    def open_step(self, step_id, plans, num_heads, num_kv_rows=None) -> None:  # noqa: ANN001
        self.opened.append({h: list(s) for h, s in plans.items()})
        self.kv_rows.append(dict(num_kv_rows))
        super().open_step(step_id, plans, num_heads, num_kv_rows)

    def attend(self, step_id, layer, inputs):  # noqa: ANN001, ANN201
        self.inputs.append({h: (x.query.shape[0], x.key.shape[0], x.value.shape[0]) for h, x in inputs.items()})
        return super().attend(step_id, layer, inputs)


def test_a_step_is_planned_once_per_server_with_counts_only():
    """Block size 4. "a" has 10 tokens over [A, B, A]; "b" 3 tokens on [C]. A step of a's tokens 8, 9 and
    b's whole prompt: A gets a (it holds a's keys and both new tokens), B gets a (keys only), C gets b."""
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    holders = {h: RManager(4, layout) for h in (A, B, C)}
    order = {"a": [A, B, A], "b": [C]}

    class Fixed(LocalPlacement):
        def place(self, seq_id, n, first_index, near=None):  # noqa: ANN001, ANN202
            refs = []
            for i in range(first_index, first_index + n):
                refs.append(BlockRef(order[seq_id][i], self.holders[order[seq_id][i]].allocate(seq_id, [i])[0]))
            return refs

    transport = RecordingTransport(holders)
    dist = DistAttention(Fixed(holders), transport, layout.block_size)
    assert dist.try_allocate("a", 3) and dist.try_allocate("b", 1)
    step = [SeqStep("a", 8, 2), SeqStep("b", 0, 3)]
    with dist.prepare(step, num_heads=4) as attention:
        for layer in range(2):
            attention(layer, torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8))
    # each with the rBlocks of its context the table puts on that holder (a on A: indices 0 and 2)
    a_on = {h: SeqStep("a", 8, 2, num_blocks_here=n) for h, n in ((A, 2), (B, 1))}
    assert transport.opened == [{A: [a_on[A]], B: [a_on[B]], C: [SeqStep("b", 0, 3, num_blocks_here=1)]}]
    assert transport.kv_rows == [{A: 2, B: 0, C: 3}]  # the rows each layer sends, announced at open
    assert transport.inputs == [{A: (2, 2, 2), B: (2, 0, 0), C: (3, 3, 3)}] * 2
    assert holders[A].plan_step([step[0]]).slot_mapping.tolist() == [1 * 4 + 0, 1 * 4 + 1]  # block 2 is id 1 on A


@pytest.fixture
def remote_engine(default_weights, make_pair):
    """An engine whose KV lives on 3 real attention servers, rBlocks placed round-robin (A, B, C, A, ...)."""
    model_config, state_dict, tokenizer = default_weights
    layout = KVLayout(model_config.num_hidden_layers, 4, model_config.num_key_value_heads, model_config.head_dim)
    pairs = {s: make_pair(96, layout, s, mirrored=False) for s in ("A", "B", "C")}
    placement = TablePlacement(pairs)

    class RoundRobin(dict):
        def __missing__(self, seq_id):  # noqa: ANN001, ANN204
            return ["A", "B", "C"] * 100

    placement.servers = RoundRobin()
    placement.num_total_blocks = 3 * 96
    kv = DistAttention(placement, GrpcTransport(lambda s: pairs[s].address, timeout_s=30), block_size=4)
    engine = LLMEngine.from_weights(model_config, state_dict, tokenizer, EngineConfig(block_size=4), kv=kv)
    return engine, pairs


def test_greedy_output_over_grpc_servers_equals_the_in_process_engine(remote_engine, make_engine):
    remote, pairs = remote_engine
    local = make_engine(block_size=4, num_partitions=3, num_kv_blocks=3 * 96)
    words = "the quick brown fox jumps over the lazy dog while a small cat watches from the old wooden fence "
    ids = local.tokenizer.encode(words * 4)
    prompts = [ids[:n] for n in (1, 3, 4, 5, 11, 12, 13, 37)]  # around block (4) and server (12) boundaries
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in local.generate(prompts, params)]
    got = [o.token_ids for o in remote.generate(prompts, params)]
    assert got == want
    for pair in pairs.values():  # every rBlock back on the free list
        stats = pair.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert (stats.num_free, stats.num_sequences) == (96, 0)
