"""Token constraints: the bitmask layout, rows masked exactly, unconstrained rows untouched."""

import torch

from infinite_llm.core.constraints import (
    ComputeOnWait,
    apply_forbidden,
    bitmask_words,
    forbidden_tokens,
    unpack_bitmask,
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
    allowed = unpack_bitmask(bitmask, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 32, 69]


def test_constrained_rows_keep_only_allowed_logits_and_others_are_untouched():
    logits = torch.arange(140, dtype=torch.float32).reshape(2, 70)
    assert apply_forbidden(logits, forbidden_tokens([None, None], logits.shape[1])) is logits
    out = apply_forbidden(logits, forbidden_tokens([None, Allow(3, 40)], logits.shape[1]))
    assert torch.equal(out[0], logits[0])
    assert out[1, 3].item() == 73.0 and out[1, 40].item() == 110.0
    assert torch.isinf(out[1]).sum().item() == 68
    assert not torch.isinf(logits).any()  # the raw logits stay intact (logprobs read them)


def test_unpacking_equals_bit_t_mod_32_of_word_t_div_32_for_every_bit_pattern():
    """The byte-table unpacking against the definition, sign bits included."""
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 7), dtype=torch.int32, generator=gen)
    bitmask[0, 0] = -1  # all 32 bits
    words = bitmask[:, :, None].to(torch.int64) & 0xFFFFFFFF
    want = ((words >> torch.arange(32)) & 1).reshape(4, -1)[:, :200].bool()
    assert torch.equal(unpack_bitmask(bitmask, 200), want)


def test_every_row_constrained_masks_each_row_by_its_own_bitmask():
    logits = torch.zeros(2, 70)
    out = apply_forbidden(logits, forbidden_tokens([Allow(1), Allow(2, 69)], logits.shape[1]))
    assert [row.isfinite().nonzero().flatten().tolist() for row in out] == [[1], [2, 69]]


def test_forbidden_tokens_is_none_without_constraints_and_all_false_on_unconstrained_rows():
    assert forbidden_tokens([None, None], 70) is None
    forbidden = forbidden_tokens([Allow(5), None], 70)
    assert forbidden.shape == (2, 70) and forbidden.dtype == torch.bool
    assert (~forbidden[0]).nonzero().flatten().tolist() == [5]
    assert not forbidden[1].any()


def test_compute_on_wait_gives_the_masks_of_the_constraints_state_when_started():
    constraint = Allow(7)
    wait = ComputeOnWait().start([constraint], 70)
    assert (~wait()[0]).nonzero().flatten().tolist() == [7]
