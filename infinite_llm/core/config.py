"""Frozen configuration dataclasses of the core: the model's architecture and the engine's limits.

Built once at the entry point (``models/`` builds :class:`ModelConfig` from a checkpoint), validated with
messages that carry the bad value; components receive only the fields they use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Tokens per rBlock unless a deployment says otherwise: the one default of the whole system (every process
# of a mesh must agree; the manager refuses a member or placement with another block size).
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (HF ``rope_scaling`` with ``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2).

    Attributes mirror HF ``config.json``. ``attention_bias`` is True for Qwen2 (bias on q/k/v only).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} not divisible by heads {self.num_attention_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers in fp32 (scale by element size / 4 otherwise)."""
        assert self.head_dim is not None
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * 4
