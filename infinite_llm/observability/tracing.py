"""OpenTelemetry tracing for a service process, configured by the standard ``OTEL_*`` variables.

``OTEL_TRACES_EXPORTER``: ``otlp`` (gRPC to ``OTEL_EXPORTER_OTLP_ENDPOINT``), ``console`` (stderr), ``none``
(the default unless an OTLP endpoint is set), or our ``jsonl`` (one JSON object per finished span, appended to
``INFINITE_LLM_SPANS_PATH``; handy for tests and for grepping a local mesh). ``OTEL_SERVICE_NAME`` overrides
the service name. gRPC servers and clients (sync and asyncio) are instrumented, so the W3C trace context
travels gateway -> router -> compute -> attention servers / manager.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

log = logging.getLogger(__name__)
_configured = False
REQUEST_ID_ATTRIBUTE = "infinite_llm.request_id"  # on the spans of the gateway, the router and compute instances


class JsonLinesSpanExporter(SpanExporter):
    """Appends ``{"trace_id", "span_id", "parent_id", "name", "service", "kind", "request_id"}`` lines to a
    file (``request_id``: the span's ``infinite_llm.request_id`` attribute, or None)."""

    def __init__(self, path: str, service: str) -> None:
        self.path = path
        self.service = service
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            lines.append(
                json.dumps(
                    {
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
                        "name": s.name,
                        "service": self.service,
                        "kind": s.kind.name,
                        "request_id": (s.attributes or {}).get(REQUEST_ID_ATTRIBUTE),
                    }
                )
            )
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS


def _exporter(name: str, service: str) -> tuple[SpanExporter, bool] | None:
    """(exporter, batch?) for ``OTEL_TRACES_EXPORTER``; None for ``none``. Raises ValueError on others."""
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter(service_name=service), False
    if name == "jsonl":
        path = os.environ.get("INFINITE_LLM_SPANS_PATH")
        if not path:
            raise ValueError("OTEL_TRACES_EXPORTER=jsonl needs INFINITE_LLM_SPANS_PATH")
        return JsonLinesSpanExporter(path, service), False
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(), True
    raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported; use otlp, console, jsonl or none")


def setup_tracing(service: str) -> bool:
    """Configure tracing once per process; returns True when spans are exported somewhere."""
    global _configured
    if _configured:
        return True
    default = "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none"
    name = os.environ.get("OTEL_TRACES_EXPORTER", default).split(",")[0].strip().lower()
    service = os.environ.get("OTEL_SERVICE_NAME", service)
    chosen = _exporter(name, service)
    if chosen is None:
        return False
    exporter, batch = chosen
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _instrument_grpc()
    _configured = True
    log.info("tracing: %s spans of %s", name, service)
    return True


def _instrument_grpc() -> None:
    """Spans for every gRPC call but ``grpc.health.v1``: probes are noise, and the aio server interceptor
    breaks ``Health/Watch`` (it iterates the handler as an async generator; grpcio-health-checking's writes
    to its context), the stream gRPC's client-side health checking rides (``rpc/options.py::serving_only``)."""
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        GrpcInstrumentorClient,
        filters,
    )

    not_health = filters.negate(filters.health_check())
    GrpcAioInstrumentorServer(filter_=not_health).instrument()
    GrpcAioInstrumentorClient(filter_=not_health).instrument()
    GrpcInstrumentorClient(filter_=not_health).instrument()


def tracer(name: str = "infinite_llm") -> trace.Tracer:
    return trace.get_tracer(name)
