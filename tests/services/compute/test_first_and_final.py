"""``first_and_final_only``: a compute instance streams a request's first output and its last, the last
carrying everything since the first, so the two messages add up to exactly what the per-step stream carries
(token ids, text and logprobs), whatever the stop condition. Real engine, real SmolLM2 outputs."""

from __future__ import annotations

import pytest

from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine import RequestOutput
from infinite_llm.services.compute.servicer import FirstAndFinal
from infinite_llm.services.generate_codec import response_from_output

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


def _outputs(engine, params: SamplingParams) -> list[RequestOutput]:  # noqa: ANN001
    """Every output of one request, step by step, as the engine thread hands them to a sink."""
    rid = engine.add_request(PROMPT, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, stop=(" the",)),  # text cut by a stop string
        SamplingParams(max_tokens=1, temperature=0),  # the first output is the final one
    ],
    ids=["length", "logprobs", "stop-string", "one-token"],
)
def test_first_and_final_add_up_to_the_per_step_stream(make_engine, params):
    outs = _outputs(make_engine(num_kv_blocks=64), params)
    posted: list[RequestOutput] = []
    sink = FirstAndFinal(posted.append)
    for out in outs:
        sink(out)
    assert len(outs) == params.max_tokens or outs[-1].finish_reason == "stop"
    assert posted[0] is outs[0] and posted[-1].finished and len(posted) == min(2, len(outs))
    every, two = [response_from_output(o) for o in outs], [response_from_output(o) for o in posted]
    assert bool(every[0].logprobs) == (params.logprobs is not None)
    assert [t for m in two for t in m.token_ids] == [t for m in every for t in m.token_ids] == outs[-1].token_ids
    assert "".join(m.text for m in two) == "".join(m.text for m in every) == outs[-1].text
    assert [lp for m in two for lp in m.logprobs] == [lp for m in every for lp in m.logprobs]
    assert (two[-1].finish_reason, two[-1].usage) == (every[-1].finish_reason, every[-1].usage)


def test_errors_always_pass():
    posted = []
    sink = FirstAndFinal(posted.append)
    first = RequestOutput("r", [1], new_token_ids=[5], token_ids=[5], text="a", new_text="a")
    error = RuntimeError("the step failed")
    sink(first)
    sink(RequestOutput("r", [1], new_token_ids=[6], token_ids=[5, 6], text="ab", new_text="b"))  # held
    sink(error)
    assert posted == [first, error]
