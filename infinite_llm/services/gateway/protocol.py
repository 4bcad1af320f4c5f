"""OpenAI request and response bodies of the REST gateway, as pydantic models.

Shapes follow OpenAI's public API reference (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``)
and vLLM's OpenAI server for the few extensions (``top_k``, ``ignore_eos``, ``stop_token_ids``). Unknown
fields are ignored, as OpenAI does; fields we cannot honour are rejected by ``handlers`` with a 400. Types
are strict, as OpenAI's: ``"max_tokens": "8"`` or ``true`` is a 400, not 8 or 1 tokens (an integer is
still a number), and a number must be finite.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from infinite_llm.core.logprobs import MAX_LOGPROBS

MAX_N = 128  # OpenAI's own cap on ``n``; each choice is one request in the mesh
_INT64 = 2**63 - 1 - MAX_N  # seed + choice index must stay an int64 (the proto field)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class SamplingFields(_Body):
    """Fields shared by completions and chat completions. Other fields are kept (``model_extra``) so that
    the vLLM extensions this server does not implement are refused by name rather than ignored."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None  # None: the one model the mesh serves
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens when both are set
    temperature: float | None = Field(None, ge=0, le=2)  # None: the engine's default, 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-_INT64, le=_INT64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None
    # extensions, named as vLLM names them
    top_k: int | None = None  # None or -1: no top-k
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (vLLM: completions too)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt without generating
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: {"id", "type", "function": {"name", "arguments"}}
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        """Only an assistant's message may go without content (it then carries tool calls), as OpenAI."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or an array of content parts)")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto (default with tools), required, a function
    parallel_tool_calls: bool | None = None  # required may call several; a named function is one call
    functions: list[Any] | None = None


# ---- responses -------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """One entry per token (``gateway.logprobs`` builds it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set on a full response; on a stream's usage chunk only


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # left out when None, as OpenAI does

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):  # noqa: ANN001, ANN202
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A streamed piece of the assistant message; unset fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its "index" among the choice's calls

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # noqa: ANN001, ANN202
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
