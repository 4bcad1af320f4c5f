"""Read an HF checkpoint directory: ``config.json`` (+ ``generation_config.json``) and ``*.safetensors``.

Supports the Llama family that ``core/model.py`` computes: Llama 2/3 (incl. Llama-3 ``rope_scaling``),
Mistral, Qwen2 (q/k/v bias) and SmolLM2 (a Llama). Accepts both the classic ``rope_theta`` / ``rope_scaling``
keys and the ``rope_parameters`` dict that transformers >= 5 writes. Anything else raises
:class:`UnsupportedModel` rather than loading a model that would compute wrong outputs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infinite_llm.core.config import ModelConfig, RopeScaling
from infinite_llm.core.errors import NotFound
from infinite_llm.models.errors import UnsupportedModel

if TYPE_CHECKING:  # torch is imported where tensors are made: reading a config needs none
    import torch

logger = logging.getLogger(__name__)

# model_type -> (architecture name for ModelConfig, whether q/k/v carry a bias).
_MODEL_TYPES = {
    "llama": ("LlamaForCausalLM", False),
    "mistral": ("MistralForCausalLM", False),
    "qwen2": ("Qwen2ForCausalLM", True),  # Qwen2 always has q/k/v bias; its config has no flag for it.
}
_INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(path: str | Path) -> ModelConfig:
    """Parse ``path/config.json`` (+ ``path/generation_config.json`` if present) into a :class:`ModelConfig`.

    Raises :class:`NotFound` when config.json is missing and :class:`UnsupportedModel` for an architecture,
    activation or RoPE type this system does not compute.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise NotFound(f"no config.json in HF checkpoint directory {path}")
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    return config_from_hf_dict(json.loads(config_file.read_text()), generation)


def config_from_hf_dict(cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Build a :class:`ModelConfig` from the dicts of ``config.json`` and ``generation_config.json``.

    ``eos_token_ids`` is the union, in order, of both files' ``eos_token_id`` (each an int, a list or null).
    """
    model_type = cfg.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported (supported: {sorted(_MODEL_TYPES)})")
    architecture, attention_bias = _MODEL_TYPES[model_type]
    _check_unsupported_features(cfg)
    theta, scaling = _rope(cfg)
    eos = _as_ids(cfg.get("eos_token_id")) + _as_ids((generation or {}).get("eos_token_id"))
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        max_position_embeddings=_max_positions(cfg),
        head_dim=cfg.get("head_dim"),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=attention_bias,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        architecture=architecture,
    )


def _check_unsupported_features(cfg: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedModel` for config switches ``core/model.py`` does not implement."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("model_type") == "llama" and cfg.get("attention_bias"):
        raise UnsupportedModel("Llama attention_bias=True (bias on o_proj too) is not supported")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias=True is not supported")


def _max_positions(cfg: dict[str, Any]) -> int:
    """``max_position_embeddings``, capped at an active sliding window.

    ``core/model.py`` attends over the full context; within the window that equals sliding-window attention,
    so capping the context keeps outputs exact (Mistral v0.1 has a 4096-token window).
    """
    max_pos = cfg["max_position_embeddings"]
    window = cfg.get("sliding_window")
    active = cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")
    if active and window and window < max_pos:
        logger.warning(
            "sliding_window %d < max_position_embeddings %d: serving at most %d tokens", window, max_pos, window
        )
        return window
    return max_pos


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from ``rope_theta``/``rope_scaling`` or transformers-5 ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModel(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _as_ids(value: int | list[int] | None) -> list[int]:
    """A token id field (int, list of ints or null) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint: those the shard index names, else all in ``path``.

    Raises :class:`NotFound` when there are none (``*.bin`` pickles are not read, by design).
    """
    path = Path(path)
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NotFound(f"no *.safetensors files in HF checkpoint directory {path}")
    return files


def load_hf_state_dict(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor of the checkpoint's safetensors files (single or sharded), cast to ``dtype``
    (default fp32).

    Returns HF names -> tensors in HF orientation ([out_features, in_features]), on CPU. Non-parameter
    buffers saved by old checkpoints (``rotary_emb.inv_freq``) are dropped.
    """
    import torch
    from safetensors import safe_open

    dtype = dtype or torch.float32
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if not name.endswith("rotary_emb.inv_freq"):
                    state_dict[name] = f.get_tensor(name).to(dtype)
    return state_dict
