"""HF checkpoint loading: config.json parsing per family, and a safetensors round trip via transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from infinite_llm.core.config import ModelConfig, RopeScaling
from infinite_llm.core.errors import NotFound
from infinite_llm.models import registry
from infinite_llm.models.errors import UnsupportedModel
from infinite_llm.models.hf import config_from_hf_dict, load_hf_config, load_hf_state_dict
from tests.models.conftest import stdout_captured

LLAMA31_8B = {  # meta-llama/Llama-3.1-8B-Instruct config.json
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LLAMA31_8B_GENERATION = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6}
MISTRAL_7B_V02 = {  # mistralai/Mistral-7B-Instruct-v0.2 config.json
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
QWEN2_05B = {  # Qwen/Qwen2-0.5B-Instruct config.json
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_llama31_config_has_llama3_rope_scaling_and_union_of_eos_ids():
    cfg = config_from_hf_dict(LLAMA31_8B, LLAMA31_8B_GENERATION)
    assert cfg == ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        head_dim=128,
        rms_norm_eps=1e-05,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=128000,
        eos_token_ids=(128009, 128001, 128008),
        architecture="LlamaForCausalLM",
    )


def test_transformers5_rope_parameters_parse_like_rope_scaling():
    scaling = LLAMA31_8B["rope_scaling"]
    v5 = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    assert config_from_hf_dict(v5) == config_from_hf_dict(LLAMA31_8B)


def test_mistral_config():
    assert config_from_hf_dict(MISTRAL_7B_V02) == ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        head_dim=128,
        rms_norm_eps=1e-05,
        rope_theta=1000000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
        architecture="MistralForCausalLM",
    )


def test_mistral_sliding_window_caps_max_positions():
    cfg = config_from_hf_dict({**MISTRAL_7B_V02, "sliding_window": 4096, "rope_theta": 10000.0})
    assert cfg.max_position_embeddings == 4096


def test_qwen2_config_has_attention_bias_and_ignores_inactive_sliding_window():
    cfg = config_from_hf_dict(QWEN2_05B, {"eos_token_id": [151645, 151643]})
    assert cfg == ModelConfig(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        head_dim=64,
        rms_norm_eps=1e-06,
        rope_theta=1000000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
        architecture="Qwen2ForCausalLM",
    )


@pytest.mark.parametrize(
    "rope_scaling, rope_type",
    [
        ({"type": "linear", "factor": 2.0}, "linear"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, "yarn"),
        ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
    ],
)
def test_unsupported_rope_type_raises(rope_scaling, rope_type):
    with pytest.raises(UnsupportedModel, match=f"rope_type '{rope_type}' is not supported"):
        config_from_hf_dict({**LLAMA31_8B, "rope_scaling": rope_scaling})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
    ],
)
def test_unsupported_features_raise(change, message):
    with pytest.raises(UnsupportedModel, match=message):
        config_from_hf_dict({**LLAMA31_8B, **change})


def test_load_hf_config_reads_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B))
    (tmp_path / "generation_config.json").write_text(json.dumps(LLAMA31_8B_GENERATION))
    assert load_hf_config(tmp_path).eos_token_ids == (128009, 128001, 128008)


def test_load_hf_config_missing_raises_not_found(tmp_path):
    with pytest.raises(NotFound, match="no config.json"):
        load_hf_config(tmp_path)


def test_single_file_state_dict_is_cast_and_drops_rotary_buffers(tmp_path):
    weight = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    save_file(
        {"model.norm.weight": weight, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)},
        tmp_path / "model.safetensors",
    )
    state_dict = load_hf_state_dict(tmp_path, torch.float32)
    assert list(state_dict) == ["model.norm.weight"]
    assert state_dict["model.norm.weight"].dtype == torch.float32
    assert torch.equal(state_dict["model.norm.weight"], weight.float())


def test_state_dict_without_safetensors_raises_not_found(tmp_path):
    with pytest.raises(NotFound, match=r"no \*.safetensors"):
        load_hf_state_dict(tmp_path)


@pytest.fixture(scope="module")
def saved_hf_dir(tmp_path_factory, hf_model, hf_tokenizer) -> Path:
    """transformers' SmolLM2 saved as a sharded safetensors HF checkpoint with tokenizer files.

    A model loaded from GGUF refuses ``save_pretrained`` (its "gguf quantizer" is not serializable), so the
    same weights are moved into a plain model built from the config without ``quantization_config``.
    """
    config_dict = {k: v for k, v in hf_model.config.to_dict().items() if k != "quantization_config"}
    with torch.device("meta"):
        plain = type(hf_model)(type(hf_model.config).from_dict(config_dict))
    plain.load_state_dict(hf_model.state_dict(), assign=True)
    plain.generation_config = hf_model.generation_config
    path = tmp_path_factory.mktemp("smollm2-hf")
    plain.save_pretrained(path, max_shard_size="200MB")
    hf_tokenizer.save_pretrained(path)
    return path


def test_hf_round_trip_config_equals_gguf_config(saved_hf_dir, default_weights):
    assert (saved_hf_dir / "model.safetensors.index.json").is_file()
    assert load_hf_config(saved_hf_dir) == default_weights[0]


def test_hf_round_trip_state_dict_equals_transformers_weights(saved_hf_dir, hf_model):
    state_dict = load_hf_state_dict(saved_hf_dir, torch.float32)
    ref = hf_model.state_dict()
    assert set(state_dict) <= set(ref) and set(ref) - set(state_dict) <= {"lm_head.weight"}
    for name, tensor in state_dict.items():
        assert torch.equal(tensor, ref[name]), name


def test_load_model_files_from_hf_dir_is_checked_and_silent(saved_hf_dir, default_weights):
    resolved = registry.resolve_model(str(saved_hf_dir))
    assert (resolved.format, resolved.path, resolved.tokenizer_dir) == ("hf", saved_hf_dir, saved_hf_dir)
    with stdout_captured() as out:
        cfg, state_dict, tokenizer = registry.load_model_files(resolved, torch.bfloat16)
    assert out[0] == ""
    assert cfg == default_weights[0]
    assert "lm_head.weight" not in state_dict and len(state_dict) == 272
    assert state_dict["model.norm.weight"].dtype == torch.bfloat16
    assert tokenizer.encode("Hello world") == default_weights[2].encode("Hello world")
