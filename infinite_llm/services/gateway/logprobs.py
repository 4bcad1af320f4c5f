"""Token log-probabilities from the mesh -> OpenAI's two ``logprobs`` shapes.

Completions (legacy): ``{tokens, token_logprobs, top_logprobs, text_offset}``, one entry per token, where
``top_logprobs`` maps token text to log-probability for the ``logprobs`` most likely tokens plus the scored
token itself (vLLM's shape: up to ``logprobs + 1`` keys, which lm-eval's greedy check relies on), and an
echoed prompt's first token has ``None`` for both. Chat: ``{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}`` with exactly ``top_logprobs`` alternatives, as OpenAI does.
A token's text is its own decoding with special tokens kept (``<|im_end|>``); a piece of a multi-byte
character decodes to U+FFFD, as in vLLM. ``text_offset`` counts characters of those token texts.
"""

from __future__ import annotations

from infinite_llm.core.logprobs import TokenLogprob
from infinite_llm.services.gateway.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def token_text(tokenizer, token_id: int) -> str:  # noqa: ANN001
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer,  # noqa: ANN001
    token_ids: list[int],
    logprobs: list[TokenLogprob | None],
    text_offset: int = 0,
) -> CompletionLogprobs:
    """The completions shape of ``token_ids`` scored by ``logprobs`` (None: unscored, an echoed first
    token); offsets start at ``text_offset`` characters (a stream's earlier chunks, or an echoed prompt)."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = token_text(tokenizer, token_id)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.logprob)
        top = {token_text(tokenizer, t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        out.top_logprobs.append(top)
    return out


def end_offset(logprobs: CompletionLogprobs) -> int:
    """The offset just past the last token (where a stream's next chunk starts)."""
    if not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> ChatLogprobs:  # noqa: ANN001
    """The chat shape: each token with its text's UTF-8 bytes and its top alternatives."""
    return ChatLogprobs(content=[_chat_entry(tokenizer, lp) for lp in logprobs])


def _chat_entry(tokenizer, lp: TokenLogprob) -> ChatTokenLogprob:  # noqa: ANN001
    top = [_top(token_text(tokenizer, t), v) for t, v in lp.top]
    text = token_text(tokenizer, lp.token_id)
    return ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8")), top_logprobs=top)


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
