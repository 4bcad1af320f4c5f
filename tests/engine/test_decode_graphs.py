"""The CUDA-graph decode path (``core/decode_graphs.py``): its static buffers, run eagerly on CPU, give the
tokens of the eager engine and write exactly the KV the eager engine writes; on CUDA the captured graphs do
the same (those tests run on a GPU machine: ``benchmarks/gpu_checks.sh``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from infinite_llm.core.config import ModelConfig
from infinite_llm.core.decode_graphs import batch_buckets
from infinite_llm.core.model import LlamaForCausalLM
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from tests.device_guard import DeviceGuard

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 100:",
    "The mitochondria is",
    "Translate to French: good morning, my friend.",
    "Once upon a time in a small village,",
    "import numpy as np\n# compute the mean of a list\n",
    "The three laws of thermodynamics are",
    "Why is the sky blue?",
    "In 1492,",
]
GREEDY = SamplingParams(max_tokens=20, temperature=0)


def test_buckets_are_powers_of_two_to_eight_then_multiples_of_eight_and_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        batch_buckets(0)


@pytest.mark.parametrize("num_partitions,block_size", [(1, 16), (3, 4)])
def test_static_decode_gives_the_eager_tokens_and_writes_the_same_kv(make_engine, num_partitions, block_size):
    """Nine prompts in buckets of 1, 2, 4, 8, 9 (max_num_seqs 9): the batch shrinks as sequences finish at
    different lengths, so padding rows, holders without a sequence and new blocks all occur."""
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0) for i in range(len(PROMPTS))]
    kw = dict(num_kv_blocks=96, num_partitions=num_partitions, block_size=block_size, max_num_seqs=9)
    eager, static = make_engine(**kw), make_engine(**kw, static_decode_without_graphs=True)
    assert eager.runner.decode_graphs is None and static.runner.decode_graphs.buckets == [1, 2, 4, 8, 9]
    want = [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert [o.token_ids for o in static.generate(PROMPTS, params)] == want
    graphs = static.runner.decode_graphs
    assert graphs.num_eager >= max(p.max_tokens for p in params) - 1 and not graphs.graphs
    assert static.kv.num_free_blocks == 96
    # Padding rows and other holders' rows wrote nothing (a stray write is O(1)). The two engines run their
    # matmuls at different batch sizes (static pads to a bucket), so the KV they wrote differs by rounding:
    # up to 1.4e-5 with one thread per process (2026-12-03), hence 1e-4.
    for p, holder in static.kv.transport.holders.items():
        other = eager.kv.transport.holders[p]
        torch.testing.assert_close(holder.k_cache, other.k_cache, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(holder.v_cache, other.v_cache, atol=1e-4, rtol=1e-4)


def test_static_decode_equals_hf_around_block_boundaries(make_engine, hf_model):
    """Prompts whose decode crosses rBlock boundaries, three partitions: greedy tokens equal HF ``generate``."""
    engine = make_engine(num_kv_blocks=64, num_partitions=3, block_size=4, static_decode_without_graphs=True)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for ids, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :]
        assert out.token_ids == ref.tolist()
    assert engine.runner.decode_graphs.num_eager > 0


def test_a_static_decode_step_creates_every_tensor_on_an_explicit_device(make_engine):
    engine = make_engine(num_kv_blocks=64, num_partitions=2, block_size=4, static_decode_without_graphs=True)
    for p in PROMPTS[:3]:
        engine.add_request(p, SamplingParams(max_tokens=3, temperature=0))
    guard = DeviceGuard()
    with guard:
        while engine.has_unfinished():
            engine.step()
    assert guard.violations == [] and engine.runner.decode_graphs.num_eager > 0


def test_each_buckets_inputs_are_disjoint_views_of_one_buffer(make_engine):
    """A step is one host-to-device copy: every static input of a bucket (ids, positions, and per holder the
    block tables, block counts, context lengths and slot mapping) is a view of the bucket's one buffer, the
    views tile it exactly, and the host side writes the same memory (on CPU the buffer is its own twin)."""
    engine = make_engine(num_kv_blocks=48, num_partitions=3, block_size=4, static_decode_without_graphs=True)
    graphs = engine.runner.decode_graphs
    for batch, inputs in graphs.inputs.items():
        fields = [inputs.input_ids, inputs.positions]
        for buf in inputs.holders.values():
            fields += [buf.num_blocks, buf.context_lens, buf.slot_mapping, buf.block_ids, buf.block_indices]
            assert buf.width == 16 and buf.block_ids.tensor.shape == (batch, 16)  # 48 rBlocks over 3 holders
        base, item = inputs.buffer.data_ptr(), inputs.buffer.element_size()
        spans = sorted(((f.tensor.data_ptr() - base) // item, f.tensor.numel()) for f in fields)
        assert all(f.tensor.untyped_storage().data_ptr() == base for f in fields)
        padded = [n + n % 2 for _, n in spans]  # each field starts 16-byte aligned (Triton specializes on it)
        assert [start for start, _ in spans] == [0, *itertools.accumulate(padded[:-1])]
        assert sum(padded) == inputs.buffer.numel() and sum(n for _, n in spans) == batch * (2 + 3 * (3 + 2 * 16))
        inputs.holders[next(iter(inputs.holders))].slot_mapping.np[0] = 7  # the host view is the buffer
        assert 7 in inputs.buffer.tolist()


def test_graphs_cannot_be_captured_off_cuda(make_engine):
    from infinite_llm.core.decode_graphs import DecodeGraphs

    engine = make_engine(num_kv_blocks=16)
    holders = engine.kv.transport.holders
    with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors"):
        DecodeGraphs(engine.runner.model, engine.kv, holders, 4, 64, capture=True)


# ---- on a GPU -----------------------------------------------------------------------------------------


class TokenIds:
    """The text side of a tokenizer for prompts given as token ids (a random-weight model has no text)."""

    eos_token_ids: tuple[int, ...] = ()

    def detokenizer(self, prompt_ids=()):  # noqa: ANN001, ANN201
        return self

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def tiny_engine(device: str, dtype: torch.dtype, **overrides) -> LLMEngine:
    """A 2-layer random-weight Llama (GQA 4/2 heads, head_dim 64) on ``device``."""
    cfg = ModelConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # sharp logits: greedy tokens are not decided by rounding
    model = model.to(device=device, dtype=dtype).eval()
    config = EngineConfig(block_size=16, num_kv_blocks=256, dtype=dtype, device=device, **overrides)
    return LLMEngine(model, TokenIds(), config)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_cuda_graph_decode_gives_the_eager_tokens(dtype, num_partitions):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (5, 16, 17, 40, 63, 100, 3)]
    params = [SamplingParams(max_tokens=10 + 7 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(num_partitions=num_partitions, max_num_seqs=8)
    graphs = tiny_engine("cuda", dtype, **kw)
    eager = tiny_engine("cuda", dtype, enforce_eager=True, **kw)
    assert eager.runner.decode_graphs is None
    assert sorted(graphs.runner.decode_graphs.graphs) == [1, 2, 4, 8]
    want = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == want
    assert graphs.runner.decode_graphs.num_replays >= max(p.max_tokens for p in params) - 1
    assert graphs.kv.num_free_blocks == 256
