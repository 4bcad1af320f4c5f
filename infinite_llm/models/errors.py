"""Errors of checkpoint loading: a checkpoint this system cannot serve correctly."""

from __future__ import annotations

from infinite_llm.core.errors import InvalidRequest


class UnsupportedModel(InvalidRequest):
    """The checkpoint's architecture, RoPE type or layout is not one ``core/model.py`` computes exactly.

    Raised instead of loading something that would run but produce wrong outputs.
    """
