"""Request lifecycle: streaming text, stop conditions, abort, and typed errors for bad input."""

from __future__ import annotations

import pytest

from infinite_llm.core.errors import CapacityExhausted, ContextLengthExceeded, InvalidRequest, NotFound
from infinite_llm.core.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(num_kv_blocks=96, num_partitions=2)


def test_streamed_pieces_concatenate_to_the_final_text_and_decode(engine):
    params = SamplingParams(max_tokens=40, temperature=0)
    pieces, last = [], None
    for out in engine.stream("Tell me about the history of Paris. Café, naïve, 東京 and 🙂 are", params):
        pieces.append(out.new_text)
        last = out
    assert last.finished and last.finish_reason == "length" and len(last.token_ids) == 40
    assert "".join(pieces) == last.text == engine.tokenizer.decode(last.token_ids)


def test_stop_string_cuts_text_and_finishes_with_stop(engine):
    full = engine.generate(["Count from one to ten: one, two,"], SamplingParams(max_tokens=30, temperature=0))[0]
    assert " four" in full.text, full.text
    stop = " four"
    pieces = [
        o.new_text
        for o in engine.stream(
            "Count from one to ten: one, two,", SamplingParams(max_tokens=30, temperature=0, stop=(stop,))
        )
    ]
    text = "".join(pieces)
    assert text == full.text[: full.text.index(stop)]
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_eos_finishes_with_stop_and_ignore_eos_runs_to_length(engine):
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say only the word: yes"}])
    ids = engine.tokenizer.encode(chat, add_special_tokens=False)
    out = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.tokenizer.eos_token_ids
    assert len(out.token_ids) < 64
    forced = engine.generate([ids], SamplingParams(max_tokens=len(out.token_ids) + 3, temperature=0, ignore_eos=True))[
        0
    ]
    assert forced.finish_reason == "length" and forced.token_ids[: len(out.token_ids)] == out.token_ids


def test_abort_mid_stream_returns_every_block(engine):
    total = engine.kv.num_total_blocks
    stream = engine.stream("Write a long story about a dragon." * 20, SamplingParams(max_tokens=200, temperature=0))
    for i, _ in enumerate(stream):
        if i == 3:
            assert engine.kv.num_free_blocks < total
            break
    stream.close()  # the consumer went away: the request is aborted
    assert engine.kv.num_free_blocks == total and not engine.has_unfinished()
    rid = engine.add_request("hello there", SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    final = engine.abort(rid)
    assert (final.finished, final.finish_reason) == (True, "abort")
    assert engine.kv.num_free_blocks == total
    with pytest.raises(NotFound):
        engine.abort(rid)


@pytest.mark.parametrize(
    "prompt,params,error,match",
    [
        ("", {}, InvalidRequest, "prompt is empty"),
        ([], {}, InvalidRequest, "prompt is empty"),
        ([1, 2, 49152], {}, InvalidRequest, "outside the vocabulary"),
        ([-1], {}, InvalidRequest, "outside the vocabulary"),
        ("hi", {"stop_token_ids": [2, 49152]}, InvalidRequest, r"stop_token_ids token id 49152 is outside the vocab"),
        ("hi", {"max_tokens": 8192}, ContextLengthExceeded, "maximum length of 8192"),
        ("hi", {"max_tokens": 2000}, CapacityExhausted, "rBlocks"),
    ],
)
def test_bad_requests_raise_typed_errors_and_change_nothing(engine, prompt, params, error, match):
    with pytest.raises(error, match=match):
        engine.add_request(prompt, SamplingParams(**params))
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert engine.generate(["ok"], SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"


@pytest.mark.parametrize(
    "params,match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
    ],
)
def test_bad_sampling_parameters_are_typed_errors(params, match):
    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(**params)


def test_a_step_cut_between_layers_for_an_abort_records_nothing_and_the_others_stay_exact(engine):
    """A step interrupted mid-prefill (layer 7 of 30) samples nothing and keeps no KV accounting; the aborted
    request frees its rBlocks at once and the request beside it ends with the tokens of an undisturbed run."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = "The history of the river and the town that grew along it"
    want = engine.generate([prompt], params)[0].token_ids
    engine.clear_prefix_cache()  # both requests prefill from token 0 (earlier tests cached their prompts)
    total = engine.kv.num_total_blocks
    keep = engine.add_request(prompt, params)
    gone = engine.add_request("Write a long story about a dragon." * 8, params)
    layers_asked = []

    def cut_at_layer_7() -> bool:
        layers_asked.append(len(layers_asked))
        return len(layers_asked) == 8

    assert engine.step(cut_at_layer_7) == [] and engine.num_interrupted_steps == 1 and len(layers_asked) == 8
    seqs = {s.seq_id: s for s in engine.scheduler.running}
    assert seqs[keep].num_computed_tokens == seqs[gone].num_computed_tokens == 0  # the cut step counts for nothing
    assert engine.kv.num_free_blocks < total  # both still hold their prompt's rBlocks
    assert engine.abort(gone).finish_reason == "abort"
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step(lambda: False)})
    assert final[keep].token_ids == want
    assert engine.kv.num_free_blocks == total and engine.num_interrupted_steps == 1
