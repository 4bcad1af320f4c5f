"""Token constraints: the bitmask layout, rows masked exactly, unconstrained rows untouched."""

import torch

from infinite_llm.core.constraints import (
    ComputeOnWait,
    apply_bitmasks,
    bitmask_bias,
    bitmask_words,
    fill_bitmasks,
)


class Allow:
    """A constraint that allows a fixed set of token ids (the layout llguidance writes)."""

    def __init__(self, *ids: int) -> None:
        self.ids = ids
        self.accepted: list[int] = []

    def fill_bitmask(self, out: torch.Tensor) -> None:
        out.zero_()
        for t in self.ids:
            out[t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


def test_bit_t_mod_32_of_word_t_div_32_allows_token_t():
    assert bitmask_words(70) == 3
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    Allow(0, 31, 32, 69).fill_bitmask(bitmask[0])
    bias = bitmask_bias(bitmask, 70)
    assert bias.shape == (1, 70) and bias.dtype == torch.float32
    assert (bias[0] == 0).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert torch.isneginf(bias).sum().item() == 66


def test_constrained_rows_keep_only_allowed_logits_and_others_are_untouched():
    logits = torch.arange(140, dtype=torch.float32).reshape(2, 70)
    assert apply_bitmasks(logits, fill_bitmasks([None, None], logits.shape[1])) is logits
    out = apply_bitmasks(logits, fill_bitmasks([None, Allow(3, 40)], logits.shape[1]))
    assert torch.equal(out[0], logits[0])
    assert out[1, 3].item() == 73.0 and out[1, 40].item() == 110.0
    assert torch.isinf(out[1]).sum().item() == 68
    assert not torch.isinf(logits).any()  # the raw logits stay intact (logprobs read them)


def test_bias_is_zero_exactly_where_bit_t_mod_32_of_word_t_div_32_is_set_for_every_bit_pattern():
    """The byte-table expansion against the definition, sign bits included."""
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 7), dtype=torch.int32, generator=gen)
    bitmask[0, 0] = -1  # all 32 bits
    words = bitmask[:, :, None].to(torch.int64) & 0xFFFFFFFF
    want = ((words >> torch.arange(32)) & 1).reshape(4, -1)[:, :200].bool()
    bias = bitmask_bias(bitmask, 200)
    assert torch.equal(bias == 0, want) and torch.equal(torch.isneginf(bias), ~want)


def test_every_row_constrained_masks_each_row_by_its_own_bitmask():
    logits = torch.zeros(2, 70)
    out = apply_bitmasks(logits, fill_bitmasks([Allow(1), Allow(2, 69)], logits.shape[1]))
    assert [row.isfinite().nonzero().flatten().tolist() for row in out] == [[1], [2, 69]]


def test_an_allowed_minus_inf_logit_stays_minus_inf_and_an_unconstrained_row_keeps_its_values():
    logits = torch.tensor([[0.5, float("-inf"), 2.0], [float("-inf"), 1.0, 3.0]])
    out = apply_bitmasks(logits, fill_bitmasks([None, Allow(0, 1)], 3))
    assert out.tolist() == [[0.5, float("-inf"), 2.0], [float("-inf"), 1.0, float("-inf")]]


def test_fill_bitmasks_is_none_without_constraints_and_packs_only_the_constrained_rows():
    assert fill_bitmasks([None, None], 70) is None
    masks = fill_bitmasks([None, Allow(5), None, Allow(0, 69)], 70)
    assert masks.rows == [1, 3]
    assert masks.bitmask.shape == (2, 3) and masks.bitmask.dtype == torch.int32
    assert masks.bitmask.tolist() == [[1 << 5, 0, 0], [1, 0, 1 << 5]]


def test_compute_on_wait_gives_the_masks_of_the_constraints_state_when_started():
    constraint = Allow(7)
    wait = ComputeOnWait().start([constraint], 70)
    assert wait().bitmask.tolist() == [[1 << 7, 0, 0]]
