"""Llama-family decoder in plain torch, split at the disaggregation seam.

The dense part (embedding, RMSNorm, QKV projection + RoPE, output projection, SwiGLU MLP, LM head) lives
here and knows nothing about where KV lives: every layer hands ``(q, k, v)`` of the step's new tokens to an
``attention`` callable and gets the attention output back (DESIGN.md §3). The single-process engine passes
DistAttention over local partitions; a compute instance passes a fan-out to attention servers.

The elementwise ops between the matmuls (RMSNorm fused with the residual add, SwiGLU's ``silu_and_mul``, RoPE
on q and k) are a :class:`DenseOps` set: the torch functions here (the CPU path and the reference), or by
default the ``infinite_llm.kernels`` dispatchers, which run one Triton kernel per op on CUDA (vLLM's fusions).

Checkpoints load by HF ``LlamaForCausalLM`` names (Llama 2/3, Mistral, Qwen2 with q/k/v bias, SmolLM2) through
:meth:`LlamaForCausalLM.load_state_dict_hf`, which concatenates ``q/k/v_proj`` into one ``qkv_proj`` and
``gate/up_proj`` into one ``gate_up_proj`` (one matmul each instead of three and two; vLLM does the same).
Reference: HF transformers ``modeling_llama.py``; gpt-fast ``model.py``; vLLM ``QKVParallelLinear``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` of ``x [num_tokens, hidden]``, ``weight [hidden]`` (as HF ``LlamaRMSNorm``).

    fp32 math, cast back to ``x``'s dtype, then multiplied by ``weight`` in that dtype.
    """
    if x.dtype == torch.float32:  # one fused op; bit-identical to the three-step form below in fp32
        return nn.functional.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)`` for ``x, residual [num_tokens, hidden]`` of one dtype.

    ``x`` is a sublayer's output, ``residual`` the stream it is added to (vLLM ``fused_add_rms_norm``).
    """
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up [num_tokens, 2 * intermediate]`` (gate first): ``[num_tokens,
    intermediate]`` (vLLM ``silu_and_mul``)."""
    gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
    return nn.functional.silu(gate).mul_(up)


class RMSNorm(nn.Module):
    """Holds the ``weight [hidden]`` and ``eps`` of one :func:`rms_norm` (HF ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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


def rope_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the q and k heads of ``qkv [num_tokens, num_heads + 2 * num_kv_heads, head_dim]`` in one pass.

    Returns ``(q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim])``: views of one
    new contiguous ``[num_tokens, num_heads + num_kv_heads, head_dim]`` tensor (see :func:`apply_rope`).
    """
    qk = apply_rope(qkv[:, : num_heads + num_kv_heads], cos, sin)  # (T, H + Hkv, D)
    return qk[:, :num_heads], qk[:, num_heads:]


@dataclass(frozen=True)
class DenseOps:
    """The fusable elementwise ops of the dense layers, each with the signature of this module's torch function
    of the same name. :data:`TORCH_OPS` holds those functions; ``infinite_llm.kernels.DENSE_OPS`` dispatches
    each call by device (Triton kernels on CUDA, these functions elsewhere), and its ``for_device`` gives the
    ops one device dispatches to, so a forward resolves them once instead of once per op and layer."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_qk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
    for_device: Callable[[torch.device], DenseOps] | None = None  # None: these ops on every device


TORCH_OPS = DenseOps(rms_norm, fused_add_rms_norm, silu_and_mul, rope_qk)


def dispatched_ops() -> DenseOps:
    """``infinite_llm.kernels.DENSE_OPS``: Triton on CUDA, :data:`TORCH_OPS` elsewhere.

    Imported when called, not with this module: ``kernels`` imports this module for its torch references.
    """
    from infinite_llm.kernels import DENSE_OPS

    return DENSE_OPS


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
        self,
        layer_idx: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
        ops: DenseOps,
    ) -> torch.Tensor:
        t = x.shape[0]
        h, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, self.head_dim)  # (T, H + 2*Hkv, D)
        q, k = ops.rope_qk(qkv, cos, sin, h, hkv)  # (T, H, D), (T, Hkv, D): RoPE on q and k in one pass
        v = qkv[:, h + hkv :]  # (T, Hkv, D)
        out = attention(layer_idx, q, k, v)
        assert out.shape == q.shape, f"attention returned {tuple(out.shape)}, expected {tuple(q.shape)}"
        return self.o_proj(out.reshape(t, h * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up held as one weight ``[2 * intermediate, hidden]``.

    On an accelerator gate and up are one matmul. On the CPU, for ``CPU_SPLIT_TOKENS`` tokens (bounds
    included), they are two, over the two halves of that weight (views, no copy). SmolLM2 on the development
    machine (AMD EPYC, 2 threads, MKL; ``benchmarks/gate_up_split.py``, interleaved rounds): a decode step
    of batch 16 (``[16, 576] x [576, 3072]`` against two ``[576, 1536]``) is 5-10% faster with two, of
    batch 4 ~3%, while batch 1 is ~9% faster with one, and so is a 2,048-token chunk (~10%).
    """

    CPU_SPLIT_TOKENS = (4, 512)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: DenseOps) -> torch.Tensor:
        low, high = self.CPU_SPLIT_TOKENS  # the torch ops only: a dispatched kernel (Triton) gets gate_up whole
        if x.device.type == "cpu" and ops.silu_and_mul is silu_and_mul and low <= x.shape[0] <= high:
            gate, up = self.gate_up_proj.weight.chunk(2)  # (I, hidden) each, row blocks of one tensor
            linear = nn.functional.linear
            return self.down_proj(nn.functional.silu(linear(x, gate)).mul_(linear(x, up)))  # (T, hidden)
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))  # (T, 2I) -> (T, I) -> (T, hidden)


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
    every scheduled sequence, flattened (``num_tokens`` rows, no padding). ``ops`` are the norm, activation and
    RoPE ops it calls (default :func:`dispatched_ops`: Triton on CUDA, torch elsewhere); the choice is made
    per device, never per step, so a captured CUDA graph replays the same kernels.
    """

    def __init__(self, cfg: ModelConfig, ops: DenseOps | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ops = dispatched_ops() if ops is None else ops
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
        ops = self.ops if self.ops.for_device is None else self.ops.for_device(h.device)
        cos, sin = self.rope(positions, h.dtype)
        # vLLM's residual stream: each sublayer's output (delta) is added to the residual by the next norm,
        # fused with it; the same sums and norms as `h = h + attn(norm(h)); h = h + mlp(norm(h))`.
        residual, delta = h, None
        for i, layer in enumerate(self.model.layers):
            x, residual = _add_norm(ops, delta, residual, layer.input_layernorm)
            delta = layer.self_attn(i, x, cos, sin, attention, ops)
            x, residual = _add_norm(ops, delta, residual, layer.post_attention_layernorm)
            delta = layer.mlp(x, ops)
        # the last add and the final norm only for the rows whose logits are wanted
        delta = None if delta is None else delta[logits_indices]
        x, _ = _add_norm(ops, delta, residual[logits_indices], self.model.norm)  # (num_logits, hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(x, weight).float()

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


def _add_norm(
    ops: DenseOps, delta: torch.Tensor | None, residual: torch.Tensor, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + delta), residual + delta)``, ``[T, hidden]`` each; ``delta`` None: nothing added."""
    if delta is None:
        return ops.rms_norm(residual, norm.weight, norm.eps), residual
    return ops.fused_add_rms_norm(delta, residual, norm.weight, norm.eps)


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
