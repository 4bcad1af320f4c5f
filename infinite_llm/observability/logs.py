"""Log lines carry the current trace id (``trace_id=...``; ``-`` outside a span)."""

from __future__ import annotations

import logging
import sys

from opentelemetry import trace

FORMAT = "%(asctime)s %(levelname)s %(name)s [trace_id=%(trace_id)s]: %(message)s"


class TraceIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else "-"
        return True


def setup_logging(level: int = logging.INFO) -> None:
    """Log to stderr with trace ids (idempotent)."""
    root = logging.getLogger()
    if any(isinstance(f, TraceIdFilter) for h in root.handlers for f in h.filters):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(TraceIdFilter())
    root.handlers = [handler]
    root.setLevel(level)
