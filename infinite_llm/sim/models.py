"""Shapes of the models the simulator serves: what a step reads and computes, in bytes and FLOPs.

Figures from the models' published configs (Hugging Face ``config.json``: LLaMA2 7B/13B/70B, SmolLM2-135M,
ENV.md). The simulator never loads weights; it needs only sizes: weight bytes (read once per decode step),
KV bytes per token (what an rBlock holds, per token), and the FLOPs of the dense layers and of attention.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as the cost model sees it.

    Attributes:
        name: registry key (``llama2-7b``).
        num_params: parameters (the dense FLOPs per token are ``2 * num_params``).
        num_layers, num_heads, num_kv_heads, head_dim: attention shape (GQA when ``num_kv_heads < num_heads``).
        dtype_bytes: bytes per weight and per KV element (2 for bf16/fp16, 4 for fp32).
    """

    name: str
    num_params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token for every layer: ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def dense_flops_per_token(self) -> float:
        return 2.0 * self.num_params

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query token, key token) pair over all layers: ``q k^T`` and ``p V``, 2 each per dim."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama2-7b", 6.738e9, 32, 32, 32, 128),
        ModelShape("llama2-13b", 13.016e9, 40, 40, 40, 128),
        ModelShape("llama2-70b", 68.977e9, 80, 64, 8, 128),
        ModelShape("smollm2-135m", 134.5e6, 30, 9, 3, 64, dtype_bytes=4),  # fp32 on the CPU engine
    )
}


def get_model(name: str) -> ModelShape:
    """The shape registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
