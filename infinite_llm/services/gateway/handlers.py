"""The two generation endpoints: OpenAI request -> ``Plan`` -> router calls -> OpenAI response or SSE stream.

A non-streamed call runs its choices concurrently and answers once all finished. A streamed call waits for
the first chunk before answering, so that a request the mesh refuses (bad parameter, no KV memory) still
gets an HTTP error status; later failures become an SSE ``{"error": ...}`` event. Either way the call is
cancelled in the mesh when the client goes away (``app`` watches for the disconnect).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import BaseModel

from infinite_llm.client.sdk import CompletionChunk
from infinite_llm.core.errors import InfiniteLLMError, InvalidRequest
from infinite_llm.services.gateway import logprobs, params, tools
from infinite_llm.services.gateway.backend import RouterBackend, gather_or_cancel, merged
from infinite_llm.services.gateway.errors import error_body
from infinite_llm.services.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    Usage,
)
from infinite_llm.services.prompt_limits import check_text_length, encode_off_loop

Events = AsyncIterator[tuple[int, CompletionChunk]]  # (choice index, chunk)

log = logging.getLogger(__name__)


# ---- prompts ---------------------------------------------------------------------------------------------
# Tokenizing and chat-template rendering run on a worker thread, after a size cap checked first (the router's,
# ``prompt_limits``): a prompt of megabytes is a 400 at once, and one long but allowed prompt stalls nobody.
def prompt_items(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one text or token-id list, or a list of them."""
    raw = req.prompt
    return [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)


async def completion_prompts(req: CompletionRequest, tokenizer, max_model_len: int) -> list[list[int]]:  # noqa: ANN001
    """Token ids of each prompt; text is tokenized as the engine would (its special tokens added), off the
    event loop. Raises ``InvalidRequest`` for an empty prompt or a text too long for ``max_model_len``
    tokens, before any tokenizing."""
    items = prompt_items(req)
    if not items:
        raise InvalidRequest("prompt is empty", param="prompt")
    for i, p in enumerate(items):
        if isinstance(p, str):  # token ids too many for the context are context_length_exceeded, below
            check_text_length(len(p), max_model_len, "prompt" if len(items) == 1 else f"prompt.{i}")
    prompts = [await encode_off_loop(tokenizer, p) if isinstance(p, str) else list(p) for p in items]
    if any(not p for p in prompts):
        raise InvalidRequest("prompt is empty", param="prompt")
    return prompts


def check_choices(req: CompletionRequest | ChatCompletionRequest, max_choices: int) -> None:
    """400 when the request asks for more than ``max_choices`` choices (prompts x ``n``): each is a request
    in the mesh, so one HTTP call must not fan out without bound."""
    n = req.n or 1
    num_prompts = len(prompt_items(req)) if isinstance(req, CompletionRequest) else 1
    if num_prompts * n > max_choices:
        raise InvalidRequest(
            f"this request asks for {num_prompts * n} choices ({num_prompts} prompts x n={n}); this server "
            f"allows at most {max_choices} per request",
            param="prompt" if num_prompts > 1 else "n",
        )


def chat_text_chars(messages: list[ChatMessage]) -> int:
    """Characters of every message's content and tool calls: what the chat template renders."""
    total = 0
    for m in messages:
        content = m.content or ""
        total += len(content) if isinstance(content, str) else sum(len(part.text or "") for part in content)
        total += len(json.dumps(m.tool_calls)) if m.tool_calls else 0
    return total


def check_chat_size(req: ChatCompletionRequest, max_model_len: int) -> None:
    """400 for a chat whose messages and tool definitions (their compact JSON text, which the template or
    the system message renders in full) together cannot fit ``max_model_len`` tokens; the param is the
    larger of the two."""
    message_chars = chat_text_chars(req.messages)
    tool_chars = len(json.dumps(req.tools, separators=(",", ":"))) if req.tools else 0
    if not tool_chars:
        check_text_length(message_chars, max_model_len, param="messages")
        return
    param = "tools" if tool_chars > message_chars else "messages"
    check_text_length(message_chars + tool_chars, max_model_len, param=param, what="messages and tools")


def chat_prompt(
    messages: list[ChatMessage],
    tokenizer,  # noqa: ANN001
    special_tokens_in_content: bool = False,
    tool_plan: tools.ToolPlan | None = None,
) -> list[int]:
    """The model's chat template over ``messages`` (tool calls and tool results included, see ``tools``),
    tokenized without adding special tokens. Content is plain text (``<|im_end|>`` in a message is not the
    control token) unless ``special_tokens_in_content``."""
    rendered = []
    for i, m in enumerate(messages):
        content = m.content or ""
        if not isinstance(content, str):
            if any(part.type != "text" for part in content):
                raise InvalidRequest("only text content parts are supported", param=f"messages.{i}.content")
            content = "".join(part.text or "" for part in content)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        rendered.append(message)
    rendered, template_tools = tools.render_history(rendered, tool_plan, tokenizer)
    return tokenizer.encode_chat(
        rendered,
        add_generation_prompt=True,
        special_tokens_in_content=special_tokens_in_content,
        tools=template_tools,
    )


async def plan(
    backend: RouterBackend,
    req: CompletionRequest | ChatCompletionRequest,
    prefix: str,
    special_tokens_in_content: bool = False,
    max_choices: int = params.MAX_CHOICES_PER_REQUEST,
) -> params.Plan:
    """Validate ``req`` at the gateway (text, model, unsupported fields, choices, prompt size, context length)
    and build its ``Plan``.

    ``special_tokens_in_content``: chat message content may spell control tokens (trusted callers only).
    ``max_choices``: the most choices (prompts x ``n``) one request may ask for."""
    params.reject_invalid_text(req)
    params.reject_unsupported(req)
    check_choices(req, max_choices)
    card = await backend.model(req.model)
    chat = isinstance(req, ChatCompletionRequest)
    tool_plan = None
    if chat:
        check_chat_size(req, card.max_model_len)
        tool_plan = tools.tool_plan(req.tools, req.tool_choice, backend.tokenizer)
        render = (req.messages, backend.tokenizer, special_tokens_in_content, tool_plan)
        prompts = [await asyncio.to_thread(chat_prompt, *render)]
    else:
        prompts = await completion_prompts(req, backend.tokenizer, card.max_model_len)
    max_tokens = min(params.max_tokens(req, len(p), card.max_model_len, chat) for p in prompts)
    echo = not chat and bool(req.echo)
    sampling = params.sampling_kwargs(req, max_tokens)
    if tool_plan is not None and tool_plan.json_schema is not None:
        sampling["json_schema"] = tool_plan.json_schema
    return params.Plan(
        id=f"{prefix}-{uuid.uuid4().hex}",
        model=card.id,
        prompts=prompts,
        n=req.n or 1,
        sampling=sampling,
        seed=req.seed,
        echo=echo,
        prompt_texts=echo_texts(req, prompts, backend.tokenizer) if echo else [],
        continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
        tools=tool_plan,
    )


def echo_texts(req: CompletionRequest, prompts: list[list[int]], tokenizer) -> list[str]:  # noqa: ANN001
    """Each prompt's text as echoed: as sent, or its token ids decoded (special tokens kept)."""
    return [
        t if isinstance(t, str) else tokenizer.decode(ids, skip_special_tokens=False)
        for t, ids in zip(prompt_items(req), prompts, strict=True)
    ]


# ---- running ---------------------------------------------------------------------------------------------
async def run_to_end(backend: RouterBackend, p: params.Plan) -> list[CompletionChunk]:
    """Every choice's whole completion, in choice order."""
    return await gather_or_cancel([backend.generate(ids, rid, p.model, **s) for rid, ids, s in p.requests()])


def stream(backend: RouterBackend, p: params.Plan) -> Events:
    return merged([backend.stream(ids, rid, p.model, **s) for rid, ids, s in p.requests()])


def _usage(p: params.Plan, outs: list[CompletionChunk]) -> Usage:
    return Usage.of(p.prompt_tokens, sum(o.completion_tokens for o in outs))


def completion_piece(
    p: params.Plan,
    tokenizer,
    i: int,
    chunk: CompletionChunk,
    first: bool,
    offsets: logprobs.TextOffsets | None = None,  # noqa: ANN001
) -> tuple[str, CompletionLogprobs | None]:
    """Text and logprobs of choice ``i`` for ``chunk`` (a whole completion, or a streamed piece); the
    ``first`` piece starts with the echoed prompt; ``offsets``: the choice's text before this piece."""
    ids, lps, text = list(chunk.token_ids), list(chunk.logprobs), chunk.text
    if first and p.echo:
        prompt = p.prompts[i // p.n]
        text, ids = p.prompt_texts[i // p.n] + text, prompt + ids
        lps = [None, *chunk.prompt_logprobs, *lps] if p.logprobs else lps
    if not p.logprobs:
        return text, None
    return text, logprobs.completion_logprobs(tokenizer, ids, lps, offsets)


def completion_response(p: params.Plan, outs: list[CompletionChunk], tokenizer) -> CompletionResponse:  # noqa: ANN001
    choices = []
    for i, o in enumerate(outs):
        text, lps = completion_piece(p, tokenizer, i, o, first=True)
        choices.append(
            CompletionChoice(index=i, text=text, logprobs=lps, finish_reason=params.finish_reason(o.finish_reason))
        )
    return CompletionResponse(id=p.id, created=int(time.time()), model=p.model, choices=choices, usage=_usage(p, outs))


def chat_message(p: params.Plan, text: str, engine_reason: str | None) -> tuple[AssistantMessage, str]:
    """The assistant message of a finished answer and its finish reason (``tool_calls`` when it calls)."""
    reason = params.finish_reason(engine_reason)
    if p.tools is None or not p.tools.calls_tools:
        return AssistantMessage(content=text), reason
    content, calls = tools.parse_calls(p.tools, text)
    # calls cut short by max_tokens keep "length" (as OpenAI's): their last arguments are partial JSON
    return AssistantMessage(
        content=content, tool_calls=calls or None
    ), "tool_calls" if calls and reason == "stop" else reason


def chat_response(p: params.Plan, outs: list[CompletionChunk], tokenizer) -> ChatCompletionResponse:  # noqa: ANN001
    choices = []
    for i, o in enumerate(outs):
        message, reason = chat_message(p, o.text, o.finish_reason)
        lps = logprobs.chat_logprobs(tokenizer, o.logprobs) if p.logprobs else None
        choices.append(ChatChoice(index=i, message=message, logprobs=lps, finish_reason=reason))
    return ChatCompletionResponse(
        id=p.id, created=int(time.time()), model=p.model, choices=choices, usage=_usage(p, outs)
    )


# ---- server-sent events ----------------------------------------------------------------------------------
def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def sse_stream(bodies: AsyncIterator[BaseModel], request_id: str = "") -> AsyncIterator[str]:
    """``data: {...}`` per body, an error event if the stream fails midway (logged with ``request_id``: its
    HTTP status was 200 already), then ``data: [DONE]``."""
    try:
        async for body in bodies:
            yield sse(body)
    except InfiniteLLMError as e:
        log.warning("request %s failed mid-stream: %s: %s", request_id, type(e).__name__, e.message)
        yield sse(error_body(e))
    yield "data: [DONE]\n\n"


async def completion_chunks(
    p: params.Plan,
    events: Events,
    include_usage: bool,
    tokenizer,  # noqa: ANN001
) -> AsyncIterator[BaseModel]:
    """Per choice: text pieces (the first with the echoed prompt), each with its tokens' logprobs."""
    created, completion_tokens, offsets = int(time.time()), {}, {}  # choice -> its tokens so far, offsets
    async for i, chunk in events:
        finish = params.finish_reason(chunk.finish_reason) if chunk.finish_reason else None
        completion_tokens[i] = completion_tokens.get(i, 0) + len(chunk.token_ids)
        first = i not in offsets
        text, lps = completion_piece(p, tokenizer, i, chunk, first, offsets.setdefault(i, logprobs.TextOffsets()))
        if text or finish or (lps is not None and lps.tokens):
            choice = CompletionChoice(index=i, text=text, logprobs=lps, finish_reason=finish)
            usage = Usage.of(p.prompt_tokens, completion_tokens[i]) if p.continuous_usage else None  # as vLLM
            yield CompletionResponse(id=p.id, created=created, model=p.model, choices=[choice], usage=usage)
    if include_usage:
        total = sum(completion_tokens.values())
        yield CompletionResponse(
            id=p.id, created=created, model=p.model, choices=[], usage=Usage.of(p.prompt_tokens, total)
        )


async def chat_chunks(
    p: params.Plan,
    events: Events,
    include_usage: bool,
    tokenizer,  # noqa: ANN001
) -> AsyncIterator[BaseModel]:
    """Per choice: a first delta with the role, content deltas (with their tokens' logprobs when asked),
    then an empty delta with the finish reason. Tool calls stream as OpenAI's do: per call a delta with its
    index, id and name, then its ``arguments`` piece by piece. A named function's answer is all arguments
    (the grammar's); ``required`` and ``auto`` answers are read as they come (:class:`tools.RequiredCallStream`,
    :class:`tools.HermesCallStream`: the text around an ``auto`` answer's calls streams as content)."""
    created, completion_tokens = int(time.time()), {}  # choice -> its tokens so far

    def chunk_of(choice: ChatStreamChoice) -> ChatCompletionChunk:
        # continuous usage counts the choice's own tokens so far, as vLLM's does (0 on the role's chunk)
        usage = Usage.of(p.prompt_tokens, completion_tokens[choice.index]) if p.continuous_usage else None
        return ChatCompletionChunk(id=p.id, created=created, model=p.model, choices=[choice], usage=usage)

    calling = p.tools is not None and p.tools.calls_tools
    named = calling and p.tools.mode == "named"  # type: ignore[union-attr]
    mode = p.tools.mode if calling else None  # type: ignore[union-attr]
    parsers: dict[int, tools.RequiredCallStream | tools.HermesCallStream] = {}  # required, auto: per choice
    async for i, chunk in events:
        if i not in completion_tokens:
            completion_tokens[i] = 0
            yield chunk_of(ChatStreamChoice(index=i, delta=Delta(role="assistant", content="")))
            if named:
                head = {"index": 0, **tools.tool_call(p.tools.name, "")}  # type: ignore[union-attr]
                yield chunk_of(ChatStreamChoice(index=i, delta=Delta(tool_calls=[head])))
        completion_tokens[i] += len(chunk.token_ids)
        lps = logprobs.chat_logprobs(tokenizer, chunk.logprobs) if p.logprobs and chunk.token_ids else None
        if named:
            if chunk.text or lps is not None:
                piece = [{"index": 0, "function": {"arguments": chunk.text}}]
                yield chunk_of(ChatStreamChoice(index=i, delta=Delta(tool_calls=piece), logprobs=lps))
        elif mode == "required":
            deltas = parsers.setdefault(i, tools.RequiredCallStream()).feed(chunk.text)
            if deltas or lps is not None:
                yield chunk_of(ChatStreamChoice(index=i, delta=Delta(tool_calls=deltas or None), logprobs=lps))
        elif mode == "auto":
            text, deltas = parsers.setdefault(i, tools.HermesCallStream()).feed(chunk.text)  # type: ignore[union-attr]
            if text or deltas or lps is not None:
                delta = Delta(content=text or None, tool_calls=deltas or None)
                yield chunk_of(ChatStreamChoice(index=i, delta=delta, logprobs=lps))
        elif chunk.text or lps is not None:
            yield chunk_of(ChatStreamChoice(index=i, delta=Delta(content=chunk.text), logprobs=lps))
        if not chunk.finish_reason:
            continue
        reason = params.finish_reason(chunk.finish_reason)
        parser = parsers.pop(i, None)
        if isinstance(parser, tools.HermesCallStream) and (tail := parser.flush()):
            yield chunk_of(ChatStreamChoice(index=i, delta=Delta(content=tail)))
        if named or (parser is not None and parser.calls > 0):  # calls completed, or cut by max_tokens (length)
            reason = "tool_calls" if reason == "stop" else reason
        elif mode == "required":  # no call read from the answer: parsed whole, as a unary reply is
            message, reason = chat_message(p, parser.text if parser is not None else "", chunk.finish_reason)
            calls = [{"index": n, **c} for n, c in enumerate(message.tool_calls or [])]
            if message.content or calls:  # an answer cut before its first call's name has neither
                delta = Delta(content=message.content, tool_calls=calls or None)
                yield chunk_of(ChatStreamChoice(index=i, delta=delta))
        yield chunk_of(ChatStreamChoice(index=i, delta=Delta(), finish_reason=reason))
    if include_usage:
        total = sum(completion_tokens.values())
        yield ChatCompletionChunk(
            id=p.id, created=created, model=p.model, choices=[], usage=Usage.of(p.prompt_tokens, total)
        )


async def prepend(first: tuple[int, CompletionChunk], events: Events) -> Events:
    yield first
    async for item in events:
        yield item
