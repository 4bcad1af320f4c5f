"""The state-dict contract between the loaders (``hf``, ``gguf_loader``) and ``core/model.py``.

Names are HF Llama names, weights are in HF orientation ``[out_features, in_features]`` and HF's rotary layout
(rotate_half). ``lm_head.weight`` is absent when embeddings are tied.
"""

from __future__ import annotations

import torch

from infinite_llm.core.config import ModelConfig
from infinite_llm.models.errors import UnsupportedModel


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter a checkpoint of ``cfg`` must hold (and nothing else)."""
    assert cfg.head_dim is not None
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_out = cfg.num_attention_heads * cfg.head_dim
    kv_out = cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for name, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (out, hidden)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_out)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def check_state_dict(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise :class:`UnsupportedModel` naming the first missing, unexpected or mis-shaped parameters."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(state_dict))
    extra = sorted(set(state_dict) - set(want))
    if missing or extra:
        raise UnsupportedModel(
            f"checkpoint does not match the config: missing {missing[:5]} ({len(missing)} in all), "
            f"unexpected {extra[:5]} ({len(extra)} in all)"
        )
    for name, shape in want.items():
        if tuple(state_dict[name].shape) != shape:
            got = tuple(state_dict[name].shape)
            raise UnsupportedModel(f"{name} has shape {got}, the config implies {shape}")
