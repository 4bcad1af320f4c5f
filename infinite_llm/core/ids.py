"""The one rule for ids that callers choose: request ids (= sequence ids), server ids, manager ids.

An id becomes an etcd key segment (``ledger/<seq_id>``), a metric label, a log field and a gRPC field on
every hop, so it is checked once, at the edge (router, compute instance, engine, manager), and never
again: 1 to ``MAX_ID_CHARS`` characters from ``ID_CHARS`` (ASCII letters, digits, ``.``, ``_``, ``:``
and ``-``). No ``/`` (it would nest etcd keys), no whitespace or control characters, nothing that needs
escaping in a log line or a URL.
"""

from __future__ import annotations

import re

from infinite_llm.core.errors import InvalidRequest

MAX_ID_CHARS = 256  # a uuid4 hex with a prefix and a choice suffix is ~45; room for callers' own schemes
ID_CHARS = "A-Z a-z 0-9 . _ : -"
_VALID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_ID_CHARS}}}")


def check_id(kind: str, value: str) -> str:
    """``value`` if it is a valid id; else :class:`InvalidRequest` with ``param=kind``.

    The message quotes at most the first 32 characters of a bad id (it may be megabytes long).
    """
    if isinstance(value, str) and _VALID.fullmatch(value):
        return value
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{kind} must be a non-empty string", param=kind)
    shown = repr(value[:32]) + (f"... ({len(value)} characters)" if len(value) > 32 else "")
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequest(f"{kind} is longer than {MAX_ID_CHARS} characters: {shown}", param=kind)
    raise InvalidRequest(f"{kind} may only hold the characters {ID_CHARS}, got {shown}", param=kind)
