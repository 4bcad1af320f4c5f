"""Size caps on prompts and texts, checked before any tokenization (issue 11: one big request must not stall
everyone), and tokenization off the serving event loop.

A text of more than ``max_model_len * MAX_CHARS_PER_TOKEN`` characters cannot fit the model in any
tokenization: no token spans more than ``MAX_CHARS_PER_TOKEN`` characters (SmolLM2's longest token, a run of
whitespace, is 81 characters; 128 leaves room for other vocabularies). Such a text is ``InvalidRequest`` at
once, before a tokenizer spends seconds on it; a token-id prompt longer than ``max_model_len`` likewise.
"""

from __future__ import annotations

import asyncio

from infinite_llm.core.errors import InvalidRequest

MAX_CHARS_PER_TOKEN = 128


def max_text_chars(max_model_len: int) -> int:
    """The most characters a text that fits ``max_model_len`` tokens can have."""
    return max_model_len * MAX_CHARS_PER_TOKEN


def check_text_length(num_chars: int, max_model_len: int, param: str, what: str | None = None) -> None:
    """Raises ``InvalidRequest`` (naming ``param``) for a text of ``num_chars`` characters, or texts of that
    many in all (a chat's messages), that cannot fit ``max_model_len`` tokens. ``what``: the texts counted,
    as the message names them (default: ``param``)."""
    if num_chars > max_text_chars(max_model_len):
        counted = f"{what} have" if what else f"{param} has"
        raise InvalidRequest(
            f"{counted} {num_chars} characters, more than any text of the model's maximum length "
            f"({max_model_len} tokens) can have ({max_text_chars(max_model_len)})",
            param=param,
        )


def check_prompt_size(prompt: str | list[int], max_model_len: int, param: str = "prompt") -> None:
    """Raises ``InvalidRequest`` (naming ``param``) for a prompt that cannot fit ``max_model_len`` tokens."""
    if isinstance(prompt, str):
        check_text_length(len(prompt), max_model_len, param)
    elif len(prompt) > max_model_len:
        raise InvalidRequest(
            f"{param} has {len(prompt)} token ids; the model's maximum length is {max_model_len}", param=param
        )


async def encode_off_loop(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:  # noqa: ANN001
    """``tokenizer.encode`` on a worker thread, so the event loop keeps serving other streams meanwhile."""
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)
