"""Generation messages <-> core types: the one place that reads ``SamplingParams`` and prompts off the wire.

Used by the compute instance (decode requests), the router (validate before choosing an instance) and the
SDK (encode). Validation raises :class:`InvalidRequest`, which the servers map to INVALID_ARGUMENT.
"""

from __future__ import annotations

from infinite_llm.core.errors import InvalidRequest
from infinite_llm.core.logprobs import TokenLogprob
from infinite_llm.core.sampling import SamplingParams
from infinite_llm.engine.outputs import RequestOutput
from infinite_llm.pb.v1 import generate_pb2 as gpb

_OPTIONAL = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "repetition_penalty",
)  # unset: the core default


def sampling_from_proto(p: gpb.SamplingParams) -> SamplingParams:
    """Core ``SamplingParams`` from the message; unset optionals take the core defaults."""
    kwargs: dict = {
        "max_tokens": p.max_tokens,
        "stop": tuple(p.stop),
        "stop_token_ids": tuple(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "logit_bias": dict(p.logit_bias),
        "min_tokens": p.min_tokens,
        "json_schema": p.json_schema or None,
        "max_tokens_defaulted": p.max_tokens_defaulted,
    }
    for name in _OPTIONAL:
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    return SamplingParams(**kwargs)


def sampling_to_proto(
    max_tokens: int,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | tuple[str, ...] = (),
    stop_token_ids: list[int] | tuple[int, ...] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    json_schema: str | None = None,
    max_tokens_defaulted: bool = False,
) -> gpb.SamplingParams:
    """The message of these parameters (the SDK's encoder; the servers validate the values).

    Raises ``InvalidRequest`` naming the parameter when a value cannot be put on the wire at all (an int
    past the field's range, a wrong type, a ``max_tokens`` of None): protobuf's own ``ValueError`` /
    ``TypeError`` names none, and an unset ``max_tokens`` would travel as 0.
    """
    if max_tokens is None:
        raise InvalidRequest("max_tokens must be a positive integer, got None", param="max_tokens")
    fields = {
        "max_tokens": max_tokens,
        "stop": list(stop),
        "stop_token_ids": list(stop_token_ids),
        "ignore_eos": ignore_eos,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "logit_bias": logit_bias or {},
        "min_tokens": min_tokens,
        "json_schema": json_schema or "",
        "max_tokens_defaulted": max_tokens_defaulted,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "repetition_penalty": repetition_penalty,
    }
    msg = gpb.SamplingParams()
    for name, value in fields.items():
        if value is None:  # an optional left unset: the core default
            continue
        try:
            msg.MergeFrom(gpb.SamplingParams(**{name: value}))
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"{name} {value!r:.40} cannot be sent: {e}", param=name) from None
    return msg


def logprob_to_proto(lp: TokenLogprob) -> gpb.TokenLogprob:
    return gpb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top=[gpb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    )


def logprob_from_proto(msg: gpb.TokenLogprob) -> TokenLogprob:
    """The core value; ``logprob`` went through a float32 field (about 7 significant digits)."""
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def prompt_from_request(req: gpb.GenerateRequest) -> str | list[int]:
    """The prompt as text or token ids; raises ``InvalidRequest`` when neither is given."""
    kind = req.WhichOneof("prompt")
    if kind == "text":
        return req.text
    if kind == "token_ids":
        return list(req.token_ids.ids)
    raise InvalidRequest("request has no prompt: set text or token_ids", param="prompt")


def response_from_output(out: RequestOutput, placement: dict[str, int] | None = None) -> gpb.GenerateResponse:
    """One streamed message: this step's new tokens and text; usage, finish reason and placement at the end."""
    msg = gpb.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text, num_preemptions=out.num_preemptions
    )
    msg.logprobs.extend(logprob_to_proto(lp) for lp in out.new_logprobs or ())
    msg.prompt_logprobs.extend(logprob_to_proto(lp) for lp in (out.prompt_logprobs or [None])[1:])
    if out.finished:
        msg.finish_reason = out.finish_reason or ""
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
        for server, n in sorted((placement or {}).items()):
            msg.placement.add(server_id=server, num_blocks=n)
    return msg
