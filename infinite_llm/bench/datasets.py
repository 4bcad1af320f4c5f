"""The requests of a benchmark: synthetic prompts of drawn lengths, a JSONL file, or windows of a long document.

Lengths are drawn as in vLLM's random dataset (``vllm/benchmarks/datasets.py``, ``RandomDataset``):
uniformly in ``[int(n * (1 - range_ratio)), int(n * (1 + range_ratio))]``. Prompts are cut from real text
through a ``PromptCodec`` that the target provides: token ids from the router's ``Tokenize`` (lengths exact)
or words for the gateway, sized by a measured tokens-per-word ratio (lengths approximate; the usage each
response reports is what the summary counts).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Common English words: synthetic prompts are sequences of real words, so they tokenize like text.
WORDS = tuple(
    """
the of and to in is was for on are as with his they at be this from have or by one had not but what all were
when we there can an your which their said if do will each about how up out them then she many some so these
would other into has more her two like him see time could no make than first been its who now people my made
over did down only way find use may water long little very after words called just where most know get through
back much before go good new write our used me man too any day same right look think also around another came
come work three word must because does part even place well such here take why things help put years different
away again off went old number great tell men say small every found still between name should home big give air
line set own under read last never us left end along while might next sound below saw something thought both few
those always looked show large often together asked house world going want school important until form food keep
children feet land side without boy once animals life enough took sometimes four head above kind began almost live
page got earth need far hand high year mother light parts country father let night following picture being study
second eyes soon times story boys since white days ever paper hard near sentence better best across during today
others however sure means knew try told young miles sun ways thing whole hear example heard several change answer
room sea against top turned learn point city play toward five using himself usually money seen car morning given
""".split()
)


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: a text or token-id prompt and the completion length asked for (tokens)."""

    prompt: str | list[int]
    max_tokens: int


class PromptCodec(Protocol):
    """How a target takes prompts: texts cut into units (token ids or words) and units joined back."""

    tokens_per_unit: float

    def units(self, text: str) -> list: ...

    def join(self, units: Sequence, tail: str) -> str | list[int]: ...

    def count(self, text: str) -> float: ...


class TokenCodec:
    """Units are token ids from ``tokenize`` (the router's ``Tokenize``): prompt lengths are exact."""

    tokens_per_unit = 1.0

    def __init__(self, tokenize: Callable[[str], list[int]]) -> None:
        self._tokenize = tokenize
        self._tails: dict[str, list[int]] = {}

    def units(self, text: str) -> list[int]:
        return list(self._tokenize(text))

    def join(self, units: Sequence[int], tail: str) -> list[int]:
        return [*units, *self._tail(tail)]

    def count(self, text: str) -> float:
        return float(len(self._tail(text)))

    def _tail(self, text: str) -> list[int]:
        if text and text not in self._tails:
            self._tails[text] = self._tokenize(text)
        return self._tails.get(text, [])


class WordCodec:
    """Units are whitespace-separated words worth ``tokens_per_word`` tokens each (measured on the target)."""

    def __init__(self, tokens_per_word: float) -> None:
        if tokens_per_word <= 0:
            raise ValueError(f"tokens per word must be positive, got {tokens_per_word}")
        self.tokens_per_unit = tokens_per_word

    def units(self, text: str) -> list[str]:
        return text.split()

    def join(self, units: Sequence[str], tail: str) -> str:
        return " ".join(units) + tail

    def count(self, text: str) -> float:
        return len(text.split()) * self.tokens_per_unit


def sample_lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    """``n`` lengths uniform in ``[int(mean * (1 - r)), int(mean * (1 + r))]``, each at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def _units_for(codec: PromptCodec, num_tokens: float) -> int:
    return max(1, round(num_tokens / codec.tokens_per_unit))


def synthetic(
    codec: PromptCodec, n: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """``n`` prompts of random common words, windows at random offsets of one pool (wrapping around)."""
    rng = random.Random(seed)
    input_lens = sample_lengths(rng, n, input_len, range_ratio)
    output_lens = sample_lengths(rng, n, output_len, range_ratio)
    # A word is at least one token, so a pool of 2 x max words holds windows of every length at many offsets.
    pool = codec.units(" ".join(rng.choice(WORDS) for _ in range(2 * max(input_lens) + 64)))
    requests = []
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        size, start = _units_for(codec, in_len), rng.randrange(len(pool))
        window = [pool[(start + i) % len(pool)] for i in range(size)]
        requests.append(BenchRequest(codec.join(window, ""), out_len))
    return requests


def jsonl(path: Path, n: int, output_len: int) -> list[BenchRequest]:
    """The first ``n`` requests of a JSONL file (cycled when it has fewer): ``{"prompt": ..., "max_tokens": ...}``.

    ``prompt`` is a string or a list of token ids; ``max_tokens`` (optional) defaults to ``output_len``.
    Raises ``ValueError`` naming the line of a malformed entry.
    """
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            items.append(_jsonl_item(line, f"{path}:{lineno}", output_len))
    if not items:
        raise ValueError(f"{path} holds no requests")
    return [items[i % len(items)] for i in range(n)]


def _jsonl_item(line: str, where: str, output_len: int) -> BenchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
    max_tokens = obj.get("max_tokens", output_len)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    return BenchRequest(prompt, max_tokens)


def long_doc(
    codec: PromptCodec, text: str, n: int, input_len: int, output_len: int, range_ratio: float, seed: int, question: str
) -> list[BenchRequest]:
    """``n`` prompts: a window of the document at a random offset, then ``question``; ~``input_len`` tokens.

    Raises ``ValueError`` when the document is shorter than the longest window.
    """
    rng = random.Random(seed)
    input_lens = sample_lengths(rng, n, input_len, range_ratio)
    output_lens = sample_lengths(rng, n, output_len, range_ratio)
    units = codec.units(text)
    tail = f"\n\nQuestion: {question}\nAnswer:"
    requests = []
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        size = _units_for(codec, in_len - codec.count(tail))
        if size > len(units):
            have = math.floor(len(units) * codec.tokens_per_unit)
            raise ValueError(f"the document has about {have} tokens, too few for prompts of {in_len} tokens")
        start = rng.randrange(len(units) - size + 1)
        requests.append(BenchRequest(codec.join(units[start : start + size], tail), out_len))
    return requests
