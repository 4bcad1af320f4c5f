"""The dense model loads HF-named weights into its fused q/k/v and gate/up projections, and computes the same."""

import pytest
import torch

from infinite_llm.core.config import ModelConfig
from infinite_llm.core.model import MLP, TORCH_OPS, AttentionFn, LlamaForCausalLM, apply_rope
from infinite_llm.kernels import ENV_FORCE
from infinite_llm.models.checkpoint import expected_shapes


def _cfg(bias: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=bias,
        bos_token_id=1,
        eos_token_ids=(2,),
        architecture="LlamaForCausalLM",
    )


def _hf_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) * 0.3 for name, shape in expected_shapes(cfg).items()}


def _unfused_logits(cfg: ModelConfig, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """HF's formulas on HF names, one sequence, plain causal softmax: ``[T, vocab]``."""
    t, nh, nkv, d = ids.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    model = LlamaForCausalLM(cfg)
    cos, sin = model.rope(torch.arange(t), torch.float32)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    def rot(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]

    h = w["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = rot(lin(x, p + "self_attn.q_proj").view(t, nh, d)).transpose(0, 1)
        k = rot(lin(x, p + "self_attn.k_proj").view(t, nkv, d)).repeat_interleave(nh // nkv, 1).transpose(0, 1)
        v = lin(x, p + "self_attn.v_proj").view(t, nkv, d).repeat_interleave(nh // nkv, 1).transpose(0, 1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
        h = h + lin(a.reshape(t, nh * d), p + "self_attn.o_proj")
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(lin(x, p + "mlp.gate_proj")) * lin(x, p + "mlp.up_proj")
        h = h + lin(mlp, p + "mlp.down_proj")
    return lin(norm(h, w["model.norm.weight"]), "lm_head")


def _causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The step's own tokens only (one sequence, positions 0..T-1): ``q [T, H, D]`` -> ``[T, H, D]``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("num_tokens", [3, 6], ids=["one-gate-up-matmul", "two-on-cpu"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_compute_what_the_hf_named_weights_say(bias, num_tokens):
    cfg = _cfg(bias)
    weights = _hf_weights(cfg)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict_hf(weights)
    ids = torch.tensor([3, 7, 1, 30, 5, 9])[:num_tokens]
    positions = torch.arange(num_tokens)
    logits = model(ids, positions, _causal_attention, positions)
    torch.testing.assert_close(logits, _unfused_logits(cfg, weights, ids), atol=1e-5, rtol=1e-5)


def test_the_cpu_gate_up_split_gives_what_the_one_matmul_gives(monkeypatch):
    low, high = MLP.CPU_SPLIT_TOKENS
    assert low <= 16 <= high and not low <= 1 <= high  # batch 16 decode splits, batch 1 does not
    mlp = MLP(_cfg(False))
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        split = mlp(x, TORCH_OPS)
        monkeypatch.setattr(MLP, "CPU_SPLIT_TOKENS", (1, 0))  # never: one matmul, then silu_and_mul
        fused = mlp(x, TORCH_OPS)
    torch.testing.assert_close(split, fused, atol=1e-6, rtol=1e-6)


def test_hf_parameter_names_are_the_checkpoint_contract():
    for bias in (False, True):
        cfg = _cfg(bias)
        assert sorted(LlamaForCausalLM(cfg).hf_parameter_names()) == sorted(expected_shapes(cfg))


def test_missing_or_unexpected_hf_names_are_reported_by_hf_name():
    cfg = _cfg(False)
    weights = _hf_weights(cfg)
    del weights["model.layers.1.self_attn.k_proj.weight"]
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_proj.weight'\].*extra"):
        LlamaForCausalLM(cfg).load_state_dict_hf(weights)


def test_rope_on_a_strided_view_equals_rotate_half():
    torch.manual_seed(0)
    x = torch.randn(5, 7, 8)[:, 1:4]  # (T, 3, D) view, as q/k heads of the fused projection
    cos, sin = torch.randn(5, 4).repeat(1, 2), torch.randn(5, 4).repeat(1, 2)
    ref = x * cos[:, None] + torch.cat((-x[..., 4:], x[..., :4]), -1) * sin[:, None]
    torch.testing.assert_close(apply_rope(x, cos, sin), ref, atol=1e-6, rtol=0)


def _residual_loop_logits(
    model: LlamaForCausalLM, ids: torch.Tensor, attention: AttentionFn, rows: torch.Tensor
) -> torch.Tensor:
    """The forward as it was before the fused ops: ``h = h + attn(norm(h)); h = h + mlp(norm(h))``, torch only."""
    cfg = model.config
    t, nh, nkv, d = ids.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def norm(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, module.weight.shape, module.weight, module.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)
        return module.weight * xf.to(x.dtype)

    h = model.model.embed_tokens(ids)
    cos, sin = model.rope(torch.arange(t), h.dtype)
    for i, layer in enumerate(model.model.layers):
        qkv = layer.self_attn.qkv_proj(norm(h, layer.input_layernorm)).view(t, nh + 2 * nkv, d)
        qk = apply_rope(qkv[:, : nh + nkv], cos, sin)
        out = attention(i, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :])
        h = h + layer.self_attn.o_proj(out.reshape(t, nh * d))
        gate, up = layer.mlp.gate_up_proj(norm(h, layer.post_attention_layernorm)).chunk(2, dim=-1)
        h = h + layer.mlp.down_proj(torch.nn.functional.silu(gate).mul_(up))
    h = norm(h[rows], model.model.norm)
    return torch.nn.functional.linear(h, model.lm_head.weight).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_carried_residual_forward_is_bit_identical_to_the_plain_residual_loop(dtype, monkeypatch):
    """On CPU the model's default ops are the torch references; the vLLM-style residual stream (add fused into
    the next norm, the last add only on the logits rows) must not change a bit of the logits. Gate and up stay
    one matmul here, as in the loop: their CPU split is its own test (a GEMM of other width may sum in another
    order: on AVX-512 the split moves fp32 logits by up to 3e-8)."""
    monkeypatch.delenv(ENV_FORCE, raising=False)
    monkeypatch.setattr(MLP, "CPU_SPLIT_TOKENS", (1, 0))  # never split
    cfg = _cfg(bias=True)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict_hf(_hf_weights(cfg))
    model = model.to(dtype)
    ids, rows = torch.tensor([3, 7, 1, 30, 5, 9, 2]), torch.tensor([0, 4, 6])
    with torch.inference_mode():
        expected = _residual_loop_logits(model, ids, _causal_attention, rows)
    assert torch.equal(model(ids, torch.arange(7), _causal_attention, rows), expected)
