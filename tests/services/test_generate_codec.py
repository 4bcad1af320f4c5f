"""The SDK's request encoder: values round-trip to the same core ``SamplingParams``, and a value the wire
cannot carry is an ``InvalidRequest`` naming its parameter (protobuf's own error names none), raised before
any call is made."""

from __future__ import annotations

import pytest

from infinite_llm.client import Client, InvalidRequest
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.services.generate_codec import sampling_from_proto, sampling_to_proto
from infinite_llm.state.etcd_launcher import free_port


def test_sampling_params_round_trip_unset_optionals_take_the_core_defaults():
    msg = sampling_to_proto(7, temperature=0.0, seed=3, stop=["."], logit_bias={5: -1.5}, logprobs=2, min_tokens=1)
    assert sampling_from_proto(msg) == SamplingParams(
        max_tokens=7, temperature=0.0, seed=3, stop=(".",), logit_bias={5: -1.5}, logprobs=2, min_tokens=1
    )
    assert not msg.HasField("top_p") and sampling_from_proto(msg).top_p == SamplingParams().top_p


def test_a_defaulted_max_tokens_crosses_the_wire_as_such_and_bad_stop_token_ids_are_refused():
    msg = sampling_to_proto(512, seed=1, max_tokens_defaulted=True)
    assert sampling_from_proto(msg) == SamplingParams(max_tokens=512, seed=1, max_tokens_defaulted=True)
    assert sampling_from_proto(sampling_to_proto(16, seed=1)).max_tokens_defaulted is False
    with pytest.raises(InvalidRequest) as e:  # what the router does with each request it is sent
        sampling_from_proto(sampling_to_proto(4, stop_token_ids=[2, -3]))
    assert e.value.param == "stop_token_ids" and str(e.value) == "stop_token_ids must be token ids >= 0, got -3"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"max_tokens": 10**12}, "max_tokens"), ({"top_k": "x"}, "top_k"), ({"seed": 2**80}, "seed")],
)
def test_a_value_the_wire_cannot_carry_is_invalid_request_naming_it(kwargs, param):
    args = {"max_tokens": 4, **kwargs}
    with pytest.raises(InvalidRequest) as e:
        sampling_to_proto(**args)
    assert e.value.param == param
    with Client(f"127.0.0.1:{free_port()}", tls=None) as client, pytest.raises(InvalidRequest) as e:
        client.generate("hi", **args)  # nobody listens there: raised before any call
    assert e.value.param == param
