"""Llama-family decoder in plain torch, split at the disaggregation seam.

The dense part (embedding, RMSNorm, QKV projection + RoPE, output projection, SwiGLU MLP, LM head) lives
here and knows nothing about where KV lives: every layer hands ``(q, k, v)`` of the step's new tokens to an
``attention`` callable and gets the attention output back (DESIGN.md §3). The single-process engine passes
DistAttention over local partitions; a compute instance passes a fan-out to attention servers.

Checkpoints load by HF ``LlamaForCausalLM`` names (Llama 2/3, Mistral, Qwen2 with q/k/v bias, SmolLM2) through
:meth:`LlamaForCausalLM.load_state_dict_hf`, which concatenates ``q/k/v_proj`` into one ``qkv_proj`` and
``gate/up_proj`` into one ``gate_up_proj`` (one matmul each instead of three and two; vLLM does the same).
Reference: HF transformers ``modeling_llama.py``; gpt-fast ``model.py``; vLLM ``QKVParallelLinear``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from infinite_llm.core.config import ModelConfig, RopeScaling

# attention(layer_idx, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> out [T, H, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# fused parameter (suffix of a layer's name) -> the HF parameters concatenated into it, in output-row order
FUSED_HF_NAMES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32 then cast back (as HF ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; bit-identical to the three-step form below in fp32
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
    """Rotate ``x [T, heads, head_dim]`` by ``cos, sin [T, head_dim]`` (HF rotate_half convention).

    ``x`` may be a strided view (q and k heads of the fused projection); the result is contiguous. Since both
    halves of ``cos``/``sin`` are equal, ``x * cos + rotate_half(x) * sin`` is written half by half, without
    materialising ``rotate_half(x)``: ``[x1*c - x2*s, x2*c + x1*s]``.
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # (T, 1, D/2)
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, c, out=out[..., :half]).addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=out[..., half:]).addcmul_(x1, s)
    return out


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
        qkv_heads = self.num_heads + 2 * self.num_kv_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        t = x.shape[0]
        h, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, self.head_dim)  # (T, H + 2*Hkv, D)
        qk = apply_rope(qkv[:, : h + hkv], cos, sin)  # (T, H + Hkv, D): RoPE on q and k in one pass
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hkv :]  # (T, H, D), (T, Hkv, D), (T, Hkv, D)
        out = attention(layer_idx, q, k, v)
        assert out.shape == q.shape, f"attention returned {tuple(out.shape)}, expected {tuple(q.shape)}"
        return self.o_proj(out.reshape(t, h * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up as one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I) each
        return self.down_proj(nn.functional.silu(gate).mul_(up))


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
        """Load HF-named weights, fusing q/k/v and gate/up (see :data:`FUSED_HF_NAMES`).

        Raises ``ValueError`` listing missing or unexpected HF names.
        """
        if self.lm_head is None:
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        want = set(self.hf_parameter_names())
        missing, unexpected = sorted(want - set(state_dict)), sorted(set(state_dict) - want)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        result = self.load_state_dict(fuse_hf_state_dict(state_dict), strict=False)
        assert not result.missing_keys and not result.unexpected_keys, result

    def hf_parameter_names(self) -> list[str]:
        """HF names of every parameter this model loads (fused parameters expanded to their parts)."""
        names = []
        for name in self.state_dict():
            layer, _, leaf = name.rpartition(".")  # leaf: weight or bias
            fused = next((f for f in FUSED_HF_NAMES if layer.endswith(f)), None)
            if fused is None:
                names.append(name)
                continue
            prefix = layer[: -len(fused)]
            names.extend(f"{prefix}{part}.{leaf}" for part in FUSED_HF_NAMES[fused])
        return names


def fuse_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> this model's names: the parts of each fused parameter concatenated along dim 0 (rows).

    Names outside :data:`FUSED_HF_NAMES` pass through; a fused parameter whose parts are incomplete is left
    unfused (so the caller reports the HF names).
    """
    out = dict(state_dict)
    for name in state_dict:
        for fused, parts in FUSED_HF_NAMES.items():
            layer, _, leaf = name.rpartition(".")
            if not layer.endswith(parts[0]):
                continue
            prefix = layer[: -len(parts[0])]
            names = [f"{prefix}{p}.{leaf}" for p in parts]
            if all(n in state_dict for n in names):
                out[f"{prefix}{fused}.{leaf}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out
