"""Tokenizer: a thin wrapper over an HF ``transformers`` tokenizer, plus a streaming detokenizer.

Loaded from an HF checkpoint directory (``tokenizer.json`` ...) or built from a GGUF file's
``tokenizer.ggml.*`` metadata by transformers' GGUF converter (slow, ~6 s: ``registry`` does it once and
caches the result with :meth:`Tokenizer.save`). Everything is offline: the HF hub is never contacted.
:class:`IncrementalDetokenizer` follows vLLM's ``detokenize_incrementally`` (prefix/read offsets).
"""

from __future__ import annotations

import functools
import json
import os
import re
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from infinite_llm.core.errors import InvalidRequest, NotFound

# Set before transformers / huggingface_hub are imported (they read it at import): never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


# transformers' class for a tokenizer that lives wholly in ``tokenizer.json`` (the ``tokenizers`` library):
# what :meth:`Tokenizer.save` writes, so every tokenizer the model cache converted from a GGUF file.
TOKENIZERS_BACKEND = "TokenizersBackend"


def _auto_tokenizer() -> Any:
    """``transformers.AutoTokenizer``, imported lazily (transformers takes ~2 s to import)."""
    from transformers import AutoTokenizer

    return AutoTokenizer


def _tokenizer_class(path: Path) -> Any:
    """The class that loads the tokenizer files in ``path``: ``TokenizersBackend`` itself when
    ``tokenizer_config.json`` names it, else ``AutoTokenizer``, which resolves the same class for that name
    but imports torch on the way (its config module does: ~3 s and ~190 MB more in the router and the
    gateway, which never run the model)."""
    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named == TOKENIZERS_BACKEND:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend
    return _auto_tokenizer()


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece byte-fallback piece


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each of the 256 bytes as a printable character, character -> byte
    (``bytes_to_unicode`` in openai/gpt-2's ``encoder.py``, which the byte-level models share)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """Text <-> token ids and chat formatting for one model.

    ``eos_token_ids``: ids that end generation, the model config's followed by the tokenizer's own eos.
    ``vocab_size``: number of tokens the tokenizer knows (may be below the model's embedding rows).
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        own_eos = [] if hf_tokenizer.eos_token_id is None else [hf_tokenizer.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos_token_ids, *own_eos]))
        self.vocab_size: int = len(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load from a directory holding HF tokenizer files; raises :class:`NotFound` if it has none."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise NotFound(f"no tokenizer.json / tokenizer_config.json in {path}")
        return cls(_tokenizer_class(path).from_pretrained(path, local_files_only=True), eos_token_ids)

    @classmethod
    def from_gguf(cls, gguf_path: str | Path, eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Convert the tokenizer stored in a GGUF file (takes ~6 s: cache it with :meth:`save`)."""
        gguf_path = Path(gguf_path)
        if not gguf_path.is_file():
            raise NotFound(f"GGUF file {gguf_path} does not exist")
        auto = _auto_tokenizer()
        return cls(
            auto.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True), eos_token_ids
        )

    def save(self, path: str | Path) -> None:
        """Write the HF tokenizer files (tokenizer.json, tokenizer_config.json, chat template) to ``path``."""
        self.hf.save_pretrained(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS etc. as the tokenizer is configured to."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 byte sequences render as U+FFFD."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for, which may be part of a multi-byte UTF-8 character (where
        :meth:`decode` of the token alone gives U+FFFD): through the byte-level alphabet of GPT-2-style BPE
        (SmolLM2, Llama 3, Qwen), a ``<0xNN>`` byte-fallback piece or a ``▁`` word boundary of SentencePiece
        (Llama 2), else the UTF-8 of the token's text (special tokens included). OpenAI's logprobs ``bytes``.
        """
        cache = self.__dict__.setdefault("_bytes_of", {})
        if token_id not in cache:
            cache[token_id] = self._token_bytes(token_id)
        return cache[token_id]

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens(int(token_id))
        if piece is None or token_id in self.hf.all_special_ids:
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if self._byte_level:
            alphabet = _byte_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        elif _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        elif "\u2581" in piece:
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the tokenizer's decoder is byte-level (GPT-2's alphabet of 256 printable characters)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return False
        return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render ``messages`` ({"role", "content"} dicts, ``tool_calls`` too) with the model's chat template;
        ``tools``: OpenAI function definitions, for templates that render them.

        Raises :class:`InvalidRequest` when the model has no chat template.
        """
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template; send a plain completion prompt", param="messages")
        return self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
        )

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` list (and so knows a tool-call format of its own)."""
        return "tools" in str(getattr(self.hf, "chat_template", None) or "")

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template holds the special tokens, so none are added.

        Message content is text: a message whose content spells a special token (``<|im_end|>``) gets
        that text's ordinary tokens, never the control token, so no message can close its turn and forge
        another role's (OpenAI treats content as text too). Content without special-token text encodes
        exactly as the whole rendered chat does. ``special_tokens_in_content=True`` parses special tokens
        in content as well (the behaviour before; for trusted callers who write raw control tokens).

        Raises :class:`InvalidRequest` when the model has no chat template, or when content holds
        special-token text and the template alters content so it cannot be kept apart.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        if special_tokens_in_content or not any(self._holds_special_text(m.get("content")) for m in messages):
            return self.encode(text, add_special_tokens=False)
        return self._encode_chat_with_plain_content(messages, add_generation_prompt, text, tools)

    def _holds_special_text(self, content: Any) -> bool:
        """Whether ``content`` spells any special added token (``all_special_tokens`` lists only the
        named ones: bos, eos...; SmolLM2 has 17 special tokens)."""
        if not isinstance(content, str):
            return False
        return any(t.special and t.content in content for t in self.hf.added_tokens_decoder.values())

    def _encode_chat_with_plain_content(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, rendered: str, tools: list[dict] | None
    ) -> list[int]:
        """Render with a unique marker in place of each content, then encode the template's pieces with
        special tokens parsed and each content with them split into ordinary tokens."""
        nonce = uuid.uuid4().hex
        marked = [
            {**m, "content": f"\ue000{nonce}:{i}\ue001"} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", self.apply_chat_template(marked, add_generation_prompt, tools))
        # pieces alternate: template text, message index, template text, ...
        contents = [messages[int(i)]["content"] for i in pieces[1::2]]
        if "".join(p for pair in zip(pieces[::2], [*contents, ""], strict=True) for p in pair) != rendered:
            raise InvalidRequest(
                "message content holds special-token text and this model's chat template changes content, so "
                "it cannot be encoded as plain text",
                param="messages",
            )
        ids: list[int] = []
        for n, piece in enumerate(pieces):
            if n % 2 == 0:
                ids += self.hf.encode(piece, add_special_tokens=False)
            else:
                ids += self.hf.encode(
                    messages[int(piece)]["content"], add_special_tokens=False, split_special_tokens=True
                )
        return ids

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one sequence whose prompt was ``prompt_ids``."""
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas for streaming.

    Invariant: ``"".join(push(t) for t in ids) + flush() == tokenizer.decode(ids)`` (without prompt ids).
    Each push decodes a short token window and returns its text past ``window[:read]`` (the context:
    the tokens emitted last, or the prompt's tail); text ending in U+FFFD (a multi-byte UTF-8 character
    split over tokens) is held back until it completes. Decoding with context keeps tokenizers that strip
    a leading space (SentencePiece) exact.
    """

    # Prompt tokens kept as left context of the first window (vLLM uses 5 as well).
    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window = list(prompt_ids)[-self.PROMPT_CONTEXT :] if prompt_ids else []
        self._read = len(self._window)  # window[:read] is context: its text is never emitted (again)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text (possibly "")."""
        self._window.append(token_id)
        context_text = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        if len(text) <= len(context_text) or text.endswith("\ufffd"):
            return ""
        # Slide: the tokens just emitted become the next window's context; older ones are forgotten.
        del self._window[: self._read]
        self._read = len(self._window)
        return text[len(context_text) :]

    def flush(self) -> str:
        """Return text still held back (an unfinished character, as U+FFFD) at the end of the sequence."""
        context_text = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        self._read = len(self._window)
        return text[len(context_text) :]
