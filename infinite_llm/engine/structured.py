"""Structured output over llguidance: a JSON schema -> a per-request token constraint for the sampler.

Why llguidance (1.9.1): it computes each step's allowed-token mask directly from the grammar and the
tokenizer's token trie (~50 us per token for JSON schemas, no ahead-of-time compilation, so a new schema
costs nothing up front), it ships as one self-contained wheel with no Python dependencies (xgrammar pulls
in a compiler toolchain and its own torch pins; outlines-core precompiles an index per schema, seconds for
large schemas), and it is maintained by the guidance team and used by vLLM, SGLang and llama.cpp. JSON is
compact (``whitespace_flexible: false``): a small model left free to emit whitespace can spin on it until
``max_tokens`` and never close the object.

The llguidance tokenizer (the vocabulary's byte strings, ~1-4 s to build) is made on the first constrained
request and kept. A step's masks are computed together by llguidance's parallel executor (the GIL
released), on a worker thread during the forward where the forward leaves the CPU idle (a GPU's, or a
compute instance's waiting on its attention servers), and right after the forward where torch's own threads
already keep every core busy (a CPU forward with local KV): :class:`GuidanceMaskPrefetch`. Their CPU time
is ~0.2-0.5 ms a sequence for ``benchmarks/structured_output.py``'s schema on the 2-core development
machine. Source: vLLM ``v1/structured_output/backend_guidance.py``; llguidance's docs on computing masks
during the forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from infinite_llm.core.constraints import StepMasks, TokenConstraint, fill_bitmasks, unfilled_masks
from infinite_llm.core.errors import InvalidRequest
from infinite_llm.engine.grammar import grammar_of


class GuidanceConstraint:
    """A :class:`~infinite_llm.core.constraints.TokenConstraint` over one ``llguidance.LLMatcher``."""

    def __init__(self, matcher) -> None:  # noqa: ANN001
        self.matcher = matcher

    def fill_bitmask(self, out: torch.Tensor) -> None:
        assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())

    def accept(self, token_id: int) -> None:
        """Consume the sampled token; once the grammar has stopped (EOS) there is nothing left to match."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token_id)


class GrammarCompiler:
    """Builds constraints for one tokenizer and vocabulary (``vocab_size``: the model's logits width)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:  # noqa: ANN001
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def ll_tokenizer(self):  # noqa: ANN201
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                eos = list(self.tokenizer.eos_token_ids)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer.hf, self.vocab_size, eos)
            return self._ll_tokenizer

    def constraint(self, json_schema: str) -> GuidanceConstraint:
        """A fresh constraint for ``json_schema``; ``InvalidRequest`` (param ``json_schema``) if unusable.

        The first token's mask is computed here (llguidance keeps it for the first step, ~0.1 ms): a grammar
        that can start no value fails on it, and would otherwise allow only EOS, an empty answer. Schemas
        with no finite value are refused before that (:mod:`.finite_schema`); this catches what that misses.
        """
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar_of(json_schema), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the JSON schema cannot be enforced: {matcher.get_error()}", param="json_schema")
        matcher.compute_bitmask()
        if matcher.is_error():
            problem = matcher.get_error().splitlines()[0]
            raise InvalidRequest(
                f"the JSON schema cannot be enforced: no value it allows can begin (llguidance: {problem})",
                param="json_schema",
            )
        return GuidanceConstraint(matcher)


def fill_guidance_bitmasks(constraints: list[TokenConstraint | None], vocab_size: int, executor) -> StepMasks | None:  # noqa: ANN001
    """:func:`~infinite_llm.core.constraints.fill_bitmasks` with llguidance's parallel executor: the masks of
    a step's llguidance constraints are computed at once on the executor's threads (the GIL released), one
    row each. Any other kind of constraint in the step falls back to the one-by-one fill. ``executor``: an
    ``llguidance.LLExecutor``. Source: ``llguidance.torch.fill_next_token_bitmask_par``, which vLLM's guidance
    backend uses."""
    masks = unfilled_masks(constraints, vocab_size)
    if masks is None:
        return None
    if not all(isinstance(constraints[i], GuidanceConstraint) for i in masks.rows):
        return fill_bitmasks(constraints, vocab_size)
    matchers = [(constraints[i].matcher, j) for j, i in enumerate(masks.rows)]
    bitmask = masks.bitmask
    executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
    return masks


class GuidanceMaskPrefetch:
    """The engine's :class:`~infinite_llm.core.constraints.MaskPrefetch`: a step's masks computed by
    :func:`fill_guidance_bitmasks` on ``num_threads`` executor threads (default: torch's intra-op thread
    count, at most 32), either

    - ``overlap=True``: on a worker thread while the model runs the step (made on the first constrained
      step; steps with no constrained sequence never touch it). Right where the forward leaves the CPU idle:
      a GPU's forward, or a compute instance waiting on its attention servers.
    - ``overlap=False``: when the sampler asks for them, right after the forward. Chosen for a CPU forward
      with local KV: torch's intra-op threads already keep every core busy, so there is nothing to hide the
      masks behind, and a thread beside them can only stall their parallel regions, while after the forward
      the executor has every core to itself. On the 2-core development machine the two schedules cost the
      same within noise (``benchmarks/structured_output.py --other-prefetch-too``, steps paired: +3.2% after
      the forward, +2.3% during it, quartiles of both about -3% to +9%).
    """

    def __init__(self, overlap: bool, num_threads: int | None = None) -> None:
        self.overlap = overlap
        self.num_threads = num_threads if num_threads is not None else max(1, min(torch.get_num_threads(), 32))
        self._executor = None
        self._pool: ThreadPoolExecutor | None = None

    def fill(self, constraints: list[TokenConstraint | None], vocab_size: int) -> StepMasks | None:
        """The masks of ``constraints`` now, on the calling thread (and the executor's)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self.num_threads)
        return fill_guidance_bitmasks(constraints, vocab_size, self._executor)

    def start(self, constraints: list[TokenConstraint | None], vocab_size: int) -> Callable[[], StepMasks | None]:
        if all(c is None for c in constraints):
            return lambda: None
        constraints = list(constraints)
        if not self.overlap:
            return lambda: self.fill(constraints, vocab_size)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._pool.submit(self.fill, constraints, vocab_size).result


def mask_prefetch_for(device: str | torch.device, remote_kv: bool) -> GuidanceMaskPrefetch:
    """The engine's mask prefetch: overlapped with the forward unless the forward runs on the CPU with
    local KV (see :class:`GuidanceMaskPrefetch`)."""
    return GuidanceMaskPrefetch(overlap=remote_kv or torch.device(device).type != "cpu")
