"""Llama-family decoder in plain torch, split at the disaggregation seam.

The dense part (embedding, RMSNorm, QKV projection + RoPE, output projection, SwiGLU MLP, LM head) lives
here and knows nothing about where KV lives: every layer hands ``(q, k, v)`` of the step's new tokens to an
``attention`` callable and gets the attention output back (DESIGN.md §3). The single-process engine passes
DistAttention over local partitions; a compute instance passes a fan-out to attention servers.

Parameter names equal HF ``LlamaForCausalLM`` so checkpoints load by name (Llama 2/3, Mistral, Qwen2 with
q/k/v bias, SmolLM2). Reference: HF transformers ``modeling_llama.py``; gpt-fast ``model.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from infinite_llm.core.config import ModelConfig, RopeScaling

# attention(layer_idx, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> out [T, H, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32 then cast back (as HF ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32, with Llama-3 scaling when given.

    Source: HF ``_compute_llama3_parameters``: long wavelengths are divided by ``factor``, short ones kept,
    the band between is interpolated smoothly.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``cos, sin [T, head_dim]`` (HF rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Projections around attention; the attention itself is the injected ``AttentionFn``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)  # (T, H, D)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        out = attention(layer_idx, q, k, v)
        assert out.shape == q.shape, f"attention returned {tuple(out.shape)}, expected {tuple(q.shape)}"
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class _Backbone(nn.Module):
    """Holds the HF ``model.*`` parameters (embed_tokens, layers, norm)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The dense layers of a Llama-family model; attention is supplied per call.

    ``forward(input_ids, positions, attention, logits_indices)`` runs one step over the step's new tokens of
    every scheduled sequence, flattened (``num_tokens`` rows, no padding).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        assert cfg.head_dim is not None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [num_tokens, head_dim]`` for int64 ``positions [num_tokens]`` (fp32 math, then ``dtype``)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """One step of the dense layers.

        Args:
            input_ids: ``[num_tokens]`` int64 token ids of the step's new tokens, sequences concatenated.
            positions: ``[num_tokens]`` int64 absolute position of each token in its sequence.
            attention: computes attention of the new queries over each sequence's whole KV (and stores the
                new K/V); see :data:`AttentionFn`.
            logits_indices: ``[num_logits]`` int64 rows whose next-token logits are wanted.

        Returns:
            ``[num_logits, vocab_size]`` fp32 logits.
        """
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, "flat [num_tokens] inputs"
        h = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rope(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            h = h + layer.self_attn(i, layer.input_layernorm(h), cos, sin, attention)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.model.norm(h[logits_indices])  # (num_logits, hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(h, weight).float()

    def load_state_dict_hf(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights; raises ``ValueError`` listing missing or unexpected names."""
        if self.lm_head is None:
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        result = self.load_state_dict(state_dict, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(
                f"checkpoint does not fit the model: missing {result.missing_keys[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
