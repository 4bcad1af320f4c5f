"""GGUF loading: the real SmolLM2 file against transformers' loader, and tiny hand-written GGUF files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from infinite_llm.core.config import ModelConfig
from infinite_llm.core.errors import NotFound
from infinite_llm.models.checkpoint import expected_shapes
from infinite_llm.models.errors import UnsupportedModel
from infinite_llm.models.gguf_loader import hf_name, load_gguf, unpermute_rows

SMOLLM2 = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    head_dim=64,
    rms_norm_eps=float(np.float32(1e-5)),
    rope_theta=100000.0,
    rope_scaling=None,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=1,
    eos_token_ids=(2,),
    architecture="LlamaForCausalLM",
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``: HF rotate_half rows -> GGUF rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_smollm2_config_has_the_documented_architecture(default_weights):
    cfg = default_weights[0]
    assert cfg == SMOLLM2


def test_smollm2_config_matches_transformers_config(default_weights, hf_model):
    cfg, ref = default_weights[0], hf_model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        ref.vocab_size,
        ref.hidden_size,
        ref.intermediate_size,
    )
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        ref.num_hidden_layers,
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
    )
    assert cfg.rms_norm_eps == ref.rms_norm_eps
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert cfg.tie_word_embeddings is ref.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (ref.bos_token_id, (ref.eos_token_id,))


def test_smollm2_weights_equal_transformers_weights(default_weights, hf_model):
    state_dict = default_weights[1]
    ref = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied to embed_tokens
    assert sorted(state_dict) == sorted(ref)
    assert len(state_dict) == 272
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        assert (tensor - ref[name]).abs().max().item() <= 1e-6, name  # assert_close is 10x slower


def test_unpermute_rows_inverts_llama_cpp_permute_for_weights_and_biases():
    rng = np.random.default_rng(0)
    weight, bias = rng.standard_normal((3 * 8, 5)), rng.standard_normal(3 * 8)  # 3 heads x head_dim 8
    for hf in (weight, bias):
        back = unpermute_rows(torch.from_numpy(llama_cpp_permute(hf, 3)), 3)
        assert torch.equal(back, torch.from_numpy(hf))


@pytest.mark.parametrize(
    "gguf_name, expected",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
        ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
        ("blk.7.ffn_gate.weight", "model.layers.7.mlp.gate_proj.weight"),
        ("blk.7.ffn_up.weight", "model.layers.7.mlp.up_proj.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
    ],
)
def test_hf_name_maps_llama_tensor_names(gguf_name, expected):
    assert hf_name(gguf_name) == expected


def test_hf_name_rejects_rope_freqs():
    with pytest.raises(UnsupportedModel, match="rope_freqs"):
        hf_name("rope_freqs.weight")


TINY = ModelConfig(
    vocab_size=10,
    hidden_size=8,
    intermediate_size=12,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    head_dim=4,
    rms_norm_eps=SMOLLM2.rms_norm_eps,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=3,
    eos_token_ids=(4, 5),
)
_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    if name in _TO_GGUF:
        return _TO_GGUF[name]
    _, _, layer, *part, kind = name.split(".")  # model.layers.N.<part>.weight
    return f"blk.{layer}.{_TO_GGUF['.'.join(part)]}.{kind}"


def write_tiny_gguf(path: Path, cfg: ModelConfig, arch: str = "llama", extra: dict[str, str] | None = None):
    """Write random ``cfg`` weights as an F32 GGUF the way llama.cpp converts HF ones; return the HF weights.

    ``extra``: additional string metadata fields.
    """
    rng = np.random.default_rng(1)
    hf = {k: rng.standard_normal(s).astype(np.float32) for k, s in expected_shapes(cfg).items()}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(4)
    writer.add_eot_token_id(5)
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    permuted = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for name, w in hf.items():
        heads = permuted.get(name.split(".")[-2])
        writer.add_tensor(_gguf_name(name), llama_cpp_permute(w, heads) if heads else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_untied_gguf_round_trips_exactly(tmp_path):
    hf = write_tiny_gguf(tmp_path / "tiny.gguf", TINY)
    cfg, state_dict = load_gguf(tmp_path / "tiny.gguf", torch.float32)
    assert cfg == TINY
    assert sorted(state_dict) == sorted(hf)  # includes lm_head.weight: untied
    for name, w in hf.items():
        assert torch.equal(state_dict[name], torch.from_numpy(w)), name


def test_load_gguf_casts_to_requested_dtype(tmp_path):
    hf = write_tiny_gguf(tmp_path / "tiny.gguf", TINY)
    _, state_dict = load_gguf(tmp_path / "tiny.gguf", torch.bfloat16)
    assert {t.dtype for t in state_dict.values()} == {torch.bfloat16}
    assert torch.equal(state_dict["lm_head.weight"], torch.from_numpy(hf["lm_head.weight"]).bfloat16())


def test_load_gguf_rejects_other_architectures(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", TINY, arch="gemma")
    with pytest.raises(UnsupportedModel, match="'gemma'"):
        load_gguf(tmp_path / "tiny.gguf")


def test_load_gguf_rejects_rope_scaling(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", TINY, extra={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(UnsupportedModel, match="'yarn'"):
        load_gguf(tmp_path / "tiny.gguf")


def test_load_gguf_missing_file_raises_not_found(tmp_path):
    with pytest.raises(NotFound, match="nope.gguf does not exist"):
        load_gguf(tmp_path / "nope.gguf")
