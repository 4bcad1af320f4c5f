"""Read a llama-architecture GGUF file into a :class:`ModelConfig` and an HF-named float state dict.

Tensors are dequantized with ``gguf.quants.dequantize`` (F32/F16/Q8_0/Q4_1/... -> float32). Two layout facts
(checked against transformers' GGUF loader, see tests/models/test_gguf_loader.py):
- GGUF lists dims fastest-first, so a ``[in, out]`` GGUF shape is an HF ``[out, in]`` weight; the dequantized
  numpy array already has the HF shape.
- llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` for its interleaved rotary layout
  (``convert_hf_to_gguf.py: LlamaModel.permute``); :func:`unpermute_rows` undoes it to get rotate_half layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf

from infinite_llm.core.config import ModelConfig
from infinite_llm.core.errors import NotFound
from infinite_llm.models.errors import UnsupportedModel

if TYPE_CHECKING:  # torch is imported where tensors are made: reading a config needs none
    import torch

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str | Path, dtype: torch.dtype | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load config and all tensors of a llama-arch GGUF file (~4 s for SmolLM2-135M on 2 cores).

    Returns HF names -> ``dtype`` tensors in HF orientation and rotary layout; ``lm_head.weight`` is absent
    when the file has no ``output.weight`` (tied embeddings). Raises :class:`NotFound` for a missing file and
    :class:`UnsupportedModel` for another architecture, RoPE scaling or an unknown tensor.
    """
    import torch

    dtype = dtype or torch.float32
    reader = open_gguf(path)
    cfg = gguf_config(reader)
    state_dict = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # (out, in) or (out,)
        if not weights.flags.writeable:  # F32/F16 come back as views of the read-only memory map
            weights = weights.copy()
        weight = torch.from_numpy(weights)
        if tensor.name.startswith("blk.") and tensor.name.split(".")[2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if ".attn_q." in tensor.name else cfg.num_key_value_heads
            weight = unpermute_rows(weight, heads)
        state_dict[name] = weight.to(dtype)
    return cfg, state_dict


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open (memory-map) a GGUF file; raises :class:`NotFound` when it does not exist."""
    if not Path(path).is_file():
        raise NotFound(f"GGUF file {path} does not exist")
    return gguf.GGUFReader(path)


def hf_name(gguf_name: str) -> str:
    """Map a llama-arch GGUF tensor name to its HF Llama name.

    ``blk.3.ffn_up.weight`` -> ``model.layers.3.mlp.up_proj.weight``, ``token_embd.weight`` ->
    ``model.embed_tokens.weight``. Raises :class:`UnsupportedModel` for tensors with no HF counterpart
    (e.g. Llama-3.1 ``rope_freqs.weight``).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise UnsupportedModel(
            f"GGUF tensor {gguf_name!r} has no Llama counterpart (rope_freqs = Llama-3.1 "
            "RoPE scaling, not supported from GGUF; load the HF checkpoint instead)"
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: rows as (heads, head_dim/2, 2) -> (heads, 2, head_dim/2).

    ``weight``: (num_heads * head_dim, in_features) or (num_heads * head_dim,) for a bias. Inverse of
    ``w.reshape(heads, 2, head_dim // 2, *rest).swapaxes(1, 2)`` in llama.cpp's ``convert_hf_to_gguf.py``.
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    head_dim = rows // num_heads
    assert num_heads * head_dim == rows and head_dim % 2 == 0, (rows, num_heads)
    # (heads, head_dim/2, 2, *rest) -> (heads, 2, head_dim/2, *rest)
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def gguf_config(reader: gguf.GGUFReader) -> ModelConfig:
    """Build a :class:`ModelConfig` from ``llama.*`` and ``tokenizer.ggml.*`` metadata and tensor names.

    ``vocab_size`` is the row count of ``token_embd.weight`` (the token list has the same length in
    well-formed files); tied embeddings iff there is no ``output.weight``.
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    _check_rope(reader)
    tensors = {t.name: t for t in reader.tensors}
    hidden = _field(reader, "llama.embedding_length")
    heads = _field(reader, "llama.attention.head_count")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shape is [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=_field(reader, "llama.feed_forward_length"),
        num_hidden_layers=_field(reader, "llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_field(reader, "llama.attention.head_count_kv", heads),
        max_position_embeddings=_field(reader, "llama.context_length"),
        head_dim=_field(reader, "llama.attention.key_length", hidden // heads),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
    )


def _check_rope(reader: gguf.GGUFReader) -> None:
    """Raise :class:`UnsupportedModel` unless RoPE is plain and covers the whole head."""
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedModel(
            f"GGUF RoPE scaling {scaling!r} / rope_freqs is not supported; load the HF checkpoint instead"
        )
    heads = _field(reader, "llama.attention.head_count")
    head_dim = _field(reader, "llama.attention.key_length", _field(reader, "llama.embedding_length") // heads)
    rotary = _field(reader, "llama.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise UnsupportedModel(f"partial rotary ({rotary} of head_dim {head_dim}) is not supported")


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata field ``key`` (int/float/str/list), or ``default`` when absent."""
    field = reader.get_field(key)
    return default if field is None else field.contents()
