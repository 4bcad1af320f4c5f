"""OpenAI request fields -> what the router is asked: token-id prompts, sampling keywords, one request per choice.

Defaults: ``max_tokens`` is 16 for a completion (OpenAI's legacy default) and ``min(512, max_model_len -
prompt tokens)`` for a chat completion (a chat answer should not stop mid-sentence, nor be bounded only by
an 8k-token context); ``temperature``/``top_p`` unset take the engine's 1.0. With a ``seed``, choice ``j``
of a prompt samples with ``seed + j``, so choices differ and each reproduces alone; without one, each
choice gets a random seed in the mesh.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from infinite_llm.core.errors import ContextLengthExceeded, InvalidRequest
from infinite_llm.engine.grammar import grammar_of
from infinite_llm.services.gateway.errors import RequestAborted
from infinite_llm.services.gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from infinite_llm.services.gateway.tools import ToolPlan

COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 512
# The most choices (prompts x n) one request may ask for, each a request in the mesh: as many as OpenAI's
# cap on n alone, so that a list of prompts cannot fan one HTTP call out without bound (GatewayConfig sets it).
MAX_CHOICES_PER_REQUEST = 128


@dataclass(frozen=True)
class Plan:
    """The router requests of one API call: choice ``i = prompt_index * n + j`` samples ``prompts[p]``."""

    id: str
    model: str
    prompts: list[list[int]]
    n: int
    sampling: dict = field(default_factory=dict)  # AsyncClient keywords, seed excluded
    seed: int | None = None
    echo: bool = False  # completions: the prompt's text (and its logprobs) come first in each choice
    prompt_texts: list[str] = field(default_factory=list)  # per prompt, for echo
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: every chunk carries usage so far
    tools: ToolPlan | None = None  # chat with tools: how the answer becomes tool calls

    @property
    def logprobs(self) -> bool:
        """Whether each token's log-probability goes in the response."""
        return self.sampling.get("logprobs") is not None

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt, not once per choice (as OpenAI bills ``n``)."""
        return sum(len(p) for p in self.prompts)

    def requests(self) -> list[tuple[str, list[int], dict]]:
        """``(router request id, prompt ids, sampling)`` per choice, in choice-index order."""
        out = []
        for p, ids in enumerate(self.prompts):
            for j in range(self.n):
                seed = {} if self.seed is None else {"seed": self.seed + j}
                out.append((f"{self.id}-{p * self.n + j}", ids, {**self.sampling, **seed}))
        return out


def reject_invalid_text(req: SamplingFields) -> None:
    """400 naming the first string of the body that is not valid Unicode: JSON may carry a lone UTF-16
    surrogate (``"\\ud800"``, what a client sends after cutting a string between an emoji's halves), which
    no tokenizer, protobuf field or UTF-8 response can hold."""
    found = _invalid_text(req.model_dump(exclude_none=True), "")
    if found is not None:
        where, char = found
        raise InvalidRequest(
            f"{where or 'the request'} is not valid Unicode text: it holds a lone UTF-16 surrogate ({char})",
            param=where or None,
        )


def _invalid_text(value: object, where: str) -> tuple[str, str] | None:
    """``(path, escaped character)`` of the first string in ``value`` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return where, ascii(value[e.start])
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and (bad_key := _invalid_text(key, where)) is not None:
            return bad_key  # named by the object that holds the key: the key cannot be printed
        if (found := _invalid_text(item, f"{where}.{key}" if where else str(key))) is not None:
            return found
    return None


# vLLM's request extensions this server does not implement, with the value that means "off": any other value
# is a 400 naming the field (OpenAI's own unknown fields, like ``metadata`` or ``store``, are ignored).
UNSUPPORTED_EXTENSIONS: dict[str, object] = {
    "min_p": 0.0,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "allowed_token_ids": None,
    "bad_words": None,
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "logits_processors": None,
}


def reject_unsupported(req: SamplingFields) -> None:
    """400 for fields the engine cannot honour, instead of silently ignoring them."""
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED_EXTENSIONS and value not in (UNSUPPORTED_EXTENSIONS[name], None):
            raise InvalidRequest(f"{name} is not supported by this server; leave it unset", param=name)
    logit_bias(req)
    if isinstance(req, CompletionRequest):
        _reject_completion_fields(req)
    elif isinstance(req, ChatCompletionRequest):
        _reject_chat_fields(req)


def _reject_completion_fields(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise InvalidRequest("max_tokens 0 is allowed only with echo (to score the prompt)", param="max_tokens")
    if req.suffix:
        raise InvalidRequest("suffix is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise InvalidRequest("best_of is not supported by this server (only best_of == n)", param="best_of")


def _reject_chat_fields(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.functions:
        raise InvalidRequest("functions (deprecated) are not supported; send tools", param="functions")
    if req.tools and req.response_format and req.response_format.get("type", "text") != "text":
        raise InvalidRequest("tools and a JSON response_format cannot be combined", param="response_format")


def logprob_kwargs(req: SamplingFields, max_tokens: int) -> dict:
    """``logprobs`` / ``prompt_logprobs`` for the mesh: completions' ``logprobs: k`` (k top tokens; with
    ``echo`` the prompt's too, and ``max_tokens: 0`` + ``echo`` scores the prompt alone, as evaluation
    harnesses do); chat's ``logprobs: true`` with ``top_logprobs: k`` (default 0)."""
    if isinstance(req, ChatCompletionRequest):
        return {"logprobs": (req.top_logprobs or 0) if req.logprobs else None}
    assert isinstance(req, CompletionRequest)
    scored = req.logprobs if req.logprobs is not None else (0 if max_tokens == 0 else None)
    return {"logprobs": req.logprobs, "prompt_logprobs": scored if req.echo else None}


def json_schema(response_format: dict | None) -> str | None:
    """The schema (JSON text) that ``response_format`` asks the output to match, checked here so that a
    schema llguidance cannot enforce is a 400 before the mesh sees it; None for plain text.

    ``json_object``: any JSON object. ``json_schema``: ``{"json_schema": {"name", "schema", "strict"}}``;
    the schema is enforced whether or not ``strict`` is set (as vLLM does)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind != "json_schema":
        raise InvalidRequest(
            f"response_format type must be text, json_object or json_schema, got {kind!r}", param="response_format"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
        raise InvalidRequest(
            "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
            param="response_format.json_schema",
        )
    text = json.dumps(spec["schema"])
    try:
        grammar_of(text)
    except InvalidRequest as e:
        raise InvalidRequest(e.message, param="response_format.json_schema.schema") from None
    return text


def logit_bias(req: SamplingFields) -> dict[int, float]:
    """``logit_bias`` with integer token ids; 400 for a key that is not one or a bias outside [-100, 100]."""
    out = {}
    for key, bias in (req.logit_bias or {}).items():
        if not key.strip().isdigit() or not -100 <= bias <= 100:
            raise InvalidRequest(
                f"logit_bias maps token ids to biases in [-100, 100]; got {key!r}: {bias!r}", param="logit_bias"
            )
        out[int(key)] = bias
    return out


def sampling_kwargs(req: SamplingFields, max_tokens: int) -> dict:
    """The ``AsyncClient`` sampling keywords (seed excluded: it varies per choice)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    top_k = None if req.top_k in (None, -1) else req.top_k
    return {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": top_k,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": logit_bias(req),
        "min_tokens": req.min_tokens,
        "json_schema": json_schema(req.response_format),
        # unset by the client: the mesh may lower it to what its KV memory holds beside the prompt
        "max_tokens_defaulted": req.max_tokens is None and req.max_completion_tokens is None,
        **logprob_kwargs(req, max_tokens),
    }


def max_tokens(req: SamplingFields, prompt_len: int, max_model_len: int, chat: bool) -> int:
    """Requested (``max_completion_tokens`` wins) or default completion length, checked against the context.

    Raises ``ContextLengthExceeded`` (400 ``context_length_exceeded``) when prompt + completion cannot fit.
    """
    field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = getattr(req, field_name)
    room = max_model_len - prompt_len
    if requested is None:
        requested = min(CHAT_DEFAULT_MAX_TOKENS, room) if chat else COMPLETION_DEFAULT_MAX_TOKENS
    if requested > room or room <= 0:
        where = "messages" if chat else "prompt"
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max(requested, 0)} tokens ({prompt_len} in the {where}, {max(requested, 0)} in the "
            f"completion). Please reduce the length of the {where} or completion.",
            param=where if room <= 0 else field_name,  # the field the client sent
        )
    return requested


def finish_reason(engine_reason: str | None) -> str:
    """The ``finish_reason`` to report: ``stop``, ``length``, or ``abort`` for a request aborted in the mesh
    (a Router ``Abort``: the output so far is partial), as vLLM's OpenAI server reports it."""
    if engine_reason in ("stop", "length", "abort"):
        return engine_reason
    raise RequestAborted(f"the request ended without a finish reason ({engine_reason!r})")
