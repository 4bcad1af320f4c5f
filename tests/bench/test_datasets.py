"""The benchmark's requests: drawn lengths, synthetic prompts of exact token lengths, JSONL files, windows of
a long document. A fake tokenizer (one id per character) stands in for the router's ``Tokenize``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from infinite_llm.bench import datasets
from infinite_llm.bench.datasets import BenchRequest, TokenCodec, WordCodec

LONG_DOCUMENT = "/usr/share/common-licenses/GPL-3"


def char_ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_lengths_are_fixed_with_range_ratio_zero():
    assert datasets.sample_lengths(random.Random(0), 5, 32, 0.0) == [32] * 5


def test_lengths_stay_within_the_range_and_cover_it():
    lengths = datasets.sample_lengths(random.Random(1), 2000, 100, 0.5)
    assert (min(lengths), max(lengths)) == (50, 150)


def test_lengths_are_at_least_one_and_reject_a_bad_ratio():
    assert datasets.sample_lengths(random.Random(0), 3, 1, 0.9) == [1, 1, 1]
    with pytest.raises(ValueError, match=r"range ratio must be in \[0, 1\), got 1.0"):
        datasets.sample_lengths(random.Random(0), 1, 8, 1.0)


def test_synthetic_prompts_have_exact_token_lengths_and_are_reproducible():
    reqs = datasets.synthetic(TokenCodec(char_ids), n=6, input_len=40, output_len=8, range_ratio=0.25, seed=3)
    again = datasets.synthetic(TokenCodec(char_ids), n=6, input_len=40, output_len=8, range_ratio=0.25, seed=3)
    assert reqs == again
    rng = random.Random(3)
    assert [len(r.prompt) for r in reqs] == datasets.sample_lengths(rng, 6, 40, 0.25)
    assert [r.max_tokens for r in reqs] == datasets.sample_lengths(rng, 6, 8, 0.25)
    assert len({tuple(r.prompt) for r in reqs}) == 6  # windows at different offsets


def test_synthetic_prompts_are_real_words_for_the_gateway():
    reqs = datasets.synthetic(WordCodec(tokens_per_word=2.0), n=3, input_len=20, output_len=4, range_ratio=0, seed=0)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 10 for r in reqs)
    assert all(w in datasets.WORDS for r in reqs for w in r.prompt.split())


def test_jsonl_cycles_through_the_file_with_default_max_tokens(tmp_path: Path):
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"prompt": "a b c", "max_tokens": 5}\n\n{"prompt": [1, 2, 3]}\n', encoding="utf-8")
    assert datasets.jsonl(path, 3, output_len=7) == [
        BenchRequest("a b c", 5),
        BenchRequest([1, 2, 3], 7),
        BenchRequest("a b c", 5),
    ]


@pytest.mark.parametrize(
    "line,message",
    [
        ("not json", "line.jsonl:2: not JSON"),
        ('{"text": "hi"}', "'prompt' must be a non-empty string or list of token ids"),
        ('{"prompt": ""}', "'prompt' must be a non-empty string"),
        ('{"prompt": "hi", "max_tokens": 0}', "'max_tokens' must be a positive integer, got 0"),
    ],
)
def test_jsonl_names_the_line_of_a_bad_entry(tmp_path: Path, line, message):
    path = tmp_path / "line.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        datasets.jsonl(path, 2, output_len=4)


def test_long_doc_prompts_are_a_window_of_the_document_then_the_question():
    text = Path(LONG_DOCUMENT).read_text(encoding="utf-8")
    codec = TokenCodec(char_ids)
    reqs = datasets.long_doc(
        codec, text, n=3, input_len=3000, output_len=16, range_ratio=0, seed=1, question="Who wrote it?"
    )
    tail = char_ids("\n\nQuestion: Who wrote it?\nAnswer:")
    for r in reqs:
        assert len(r.prompt) == 3000 and r.max_tokens == 16
        assert r.prompt[-len(tail) :] == tail
        window = "".join(map(chr, r.prompt[: -len(tail)]))
        assert window in text


def test_long_doc_refuses_a_document_shorter_than_the_prompt():
    with pytest.raises(ValueError, match="the document has about 11 tokens, too few for prompts of 100 tokens"):
        datasets.long_doc(TokenCodec(char_ids), "short text.", 1, 100, 8, 0.0, 0, "q?")
