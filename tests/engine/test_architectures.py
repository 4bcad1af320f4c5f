"""Llama 2/3, Mistral and Qwen2 configs: tiny random HF checkpoints, saved and loaded back, equal HF's logits.

These exercise what SmolLM2 does not: untied embeddings, Llama-3 RoPE scaling, q/k/v bias (Qwen2), MHA and
MQA. Each checkpoint is written by transformers' ``save_pretrained`` (safetensors), loaded by our HF loader,
run through the engine with 3 partitions, and compared with transformers' own forward.
"""

from __future__ import annotations

import pytest
import torch

from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import EngineConfig, LLMEngine
from infinite_llm.models.hf import load_hf_config, load_hf_state_dict

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama2-mha": LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4),
        "llama3-gqa-scaled-rope": LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral-mqa": MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
        "qwen2-bias": Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2),
    }


@pytest.mark.parametrize("name", ["llama2-mha", "llama3-gqa-scaled-rope", "mistral-mqa", "qwen2-bias"])
def test_tiny_checkpoint_matches_transformers(name, tmp_path, default_weights):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_configs()[name]).float().eval()
    with torch.no_grad():  # random init leaves biases at zero: make them matter
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    cfg = load_hf_config(tmp_path)
    assert cfg.attention_bias is (name == "qwen2-bias")
    assert (cfg.rope_scaling is not None) is (name == "llama3-gqa-scaled-rope")
    tokenizer = default_weights[2]  # any tokenizer works: prompts are token ids below vocab 512
    engine = LLMEngine.from_weights(
        cfg,
        load_hf_state_dict(tmp_path),
        tokenizer,
        EngineConfig(block_size=4, num_kv_blocks=64, num_partitions=3),
    )
    ids = [(7 * i + 3) % 500 for i in range(150)]  # long enough for the scaled RoPE band to matter
    captured = []
    real = engine.runner.model
    engine.runner.model = lambda *a: captured.append(real(*a)) or captured[-1]
    engine.runner.model.config = real.config
    out = engine.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    ref = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        pad_token_id=0,
        eos_token_id=None,
    )
    assert out.token_ids == ref.sequences[0, len(ids) :].tolist()
    ours = torch.cat([c for c in captured if c.shape[0]])
    assert (ours - torch.cat(ref.logits)).abs().max().item() < 1e-4
