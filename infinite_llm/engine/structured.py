"""Structured output over llguidance: a JSON schema -> a per-request token constraint for the sampler.

Why llguidance (1.9.1): it computes each step's allowed-token mask directly from the grammar and the
tokenizer's token trie (~50 us per token for JSON schemas, no ahead-of-time compilation, so a new schema
costs nothing up front), it ships as one self-contained wheel with no Python dependencies (xgrammar pulls
in a compiler toolchain and its own torch pins; outlines-core precompiles an index per schema, seconds for
large schemas), and it is maintained by the guidance team and used by vLLM, SGLang and llama.cpp. JSON is
compact (``whitespace_flexible: false``): a small model left free to emit whitespace can spin on it until
``max_tokens`` and never close the object.

The llguidance tokenizer (the vocabulary's byte strings, ~1-4 s to build) is made on the first constrained
request and kept. Each step's masks are computed on a worker thread while the model runs the step
(:class:`ThreadedMaskPrefetch`): llguidance releases the GIL while it computes a mask. That hides the masks
where the forward leaves the CPU idle (a GPU's); on a CPU device the forward keeps every core busy, so the
masks' CPU time (~0.2-0.5 ms a sequence for ``benchmarks/structured_output.py``'s schema on the 2-core
development machine) is a real cost per step, whichever thread computes them. Source: vLLM
``v1/structured_output/backend_guidance.py``; llguidance's docs on computing masks during the forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from infinite_llm.core.constraints import StepMasks, TokenConstraint, fill_bitmasks
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
        """A fresh constraint for ``json_schema``; ``InvalidRequest`` (param ``json_schema``) if unusable."""
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar_of(json_schema), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the JSON schema cannot be enforced: {matcher.get_error()}", param="json_schema")
        return GuidanceConstraint(matcher)


class ThreadedMaskPrefetch:
    """A :class:`~infinite_llm.core.constraints.MaskPrefetch` that computes a step's masks on one worker thread
    (made on the first constrained step), overlapped with the model's forward on the caller's thread. Steps
    with no constrained sequence never touch the thread."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, constraints: list[TokenConstraint | None], vocab_size: int) -> Callable[[], StepMasks | None]:
        if all(c is None for c in constraints):
            return lambda: None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._pool.submit(fill_bitmasks, list(constraints), vocab_size).result
