"""Token log-probabilities from the mesh -> OpenAI's two ``logprobs`` shapes.

Completions (legacy): ``{tokens, token_logprobs, top_logprobs, text_offset}``, one entry per token, where
``top_logprobs`` maps token text to log-probability for the ``logprobs`` most likely tokens plus the scored
token itself (vLLM's shape: up to ``logprobs + 1`` keys, which lm-eval's greedy check relies on), and an
echoed prompt's first token has ``None`` for both. Chat: ``{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}`` with exactly ``top_logprobs`` alternatives, as OpenAI does.
A token's text is its own decoding with special tokens kept (``<|im_end|>``); a piece of a multi-byte
character decodes to U+FFFD, as in vLLM. But a token's ``bytes`` are its own (``Tokenizer.token_bytes``: the
pieces of an emoji join into the emoji, which is what OpenAI's field is for), and ``text_offset`` is where the
token starts in the returned text, in characters: a token that continues a character starts where that
character does (vLLM sums the lengths of the token texts instead, which drifts by one or two characters at
every character split between tokens).
"""

from __future__ import annotations

import codecs

from infinite_llm.core.logprobs import TokenLogprob
from infinite_llm.services.gateway.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def token_text(tokenizer, token_id: int) -> str:  # noqa: ANN001
    return tokenizer.decode([token_id], skip_special_tokens=False)


class TextOffsets:
    """Character offsets of successive tokens in the text they decode to, across a stream's chunks: the
    characters completed so far, with an incomplete UTF-8 tail held back until its last byte comes."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tokenizer, token_id: int) -> int:  # noqa: ANN001
        """The offset where ``token_id`` starts; then counts its bytes in."""
        at = self.chars
        self.chars += len(self._utf8.decode(tokenizer.token_bytes(token_id)))
        return at


def completion_logprobs(
    tokenizer,  # noqa: ANN001
    token_ids: list[int],
    logprobs: list[TokenLogprob | None],
    offsets: TextOffsets | None = None,
) -> CompletionLogprobs:
    """The completions shape of ``token_ids`` scored by ``logprobs`` (None: unscored, an echoed first
    token); ``offsets`` carries the text before them (a stream's earlier chunks) and is advanced past them."""
    offsets = TextOffsets() if offsets is None else offsets
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = token_text(tokenizer, token_id)
        out.tokens.append(text)
        out.text_offset.append(offsets.push(tokenizer, token_id))
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.logprob)
        top = {token_text(tokenizer, t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> ChatLogprobs:  # noqa: ANN001
    """The chat shape: each token with its text's UTF-8 bytes and its top alternatives."""
    return ChatLogprobs(content=[_chat_entry(tokenizer, lp) for lp in logprobs])


def _chat_entry(tokenizer, lp: TokenLogprob) -> ChatTokenLogprob:  # noqa: ANN001
    top = [_top(tokenizer, t, v) for t, v in lp.top]
    text, raw = token_text(tokenizer, lp.token_id), tokenizer.token_bytes(lp.token_id)
    return ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(raw), top_logprobs=top)


def _top(tokenizer, token_id: int, logprob: float) -> TopLogprob:  # noqa: ANN001
    return TopLogprob(
        token=token_text(tokenizer, token_id), logprob=logprob, bytes=list(tokenizer.token_bytes(token_id))
    )
