"""The engine runs in bf16 and fp16 on CPU: logits close to fp32 (bf16 keeps ~3 significant digits, fp16 ~4),
same top token, the KV cache in that dtype."""

from __future__ import annotations

import pytest
import torch

from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from tests.engine.test_engine_vs_hf import LogitsRecorder


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_16_bit_engine_tracks_fp32(default_weights, half):
    model_config, state_dict, tokenizer = default_weights
    ids = tokenizer.encode("The three primary colours are red, yellow and")
    logits, tokens = {}, {}
    for dtype in (torch.float32, half):
        engine = LLMEngine.from_weights(
            model_config, state_dict, tokenizer, EngineConfig(num_kv_blocks=64, num_partitions=2, dtype=dtype)
        )
        assert next(iter(engine.kv.placement.holders.values())).k_cache.dtype == dtype  # the KV cache too
        rec = LogitsRecorder(engine)
        tokens[dtype] = engine.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        logits[dtype] = rec.steps[0][0]  # next-token logits after the prompt, fp32 [vocab]
    a, b = logits[torch.float32], logits[half]
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    assert int(a.argmax()) == int(b.argmax()) == tokens[half].token_ids[0]
    assert (a - b).abs().max() < 0.1 * a.abs().max()
