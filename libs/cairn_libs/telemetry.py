"""Logs and traces for every service, configured the same way.

structlog writes one JSON line per event carrying the current trace id and run
id. OpenTelemetry traces go to an OTLP collector only when
OTEL_EXPORTER_OTLP_ENDPOINT is set; W3C trace context rides in gRPC metadata, so
the spans of one run from all four services form one trace.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

current_run_id: contextvars.ContextVar[str] = contextvars.ContextVar("cairn_run_id", default="")

_provider: TracerProvider | None = None


def _add_trace_context(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    run_id = current_run_id.get()
    if run_id:
        event.setdefault("run_id", run_id)
    return event


def configure_logging(service: str) -> None:
    level = getattr(logging, os.environ.get("CAIRN_LOG_LEVEL", "INFO").upper(), logging.INFO)
    renderer: Any = (
        structlog.dev.ConsoleRenderer()
        if os.environ.get("CAIRN_LOG_FORMAT") == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_context,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def configure_tracing(service: str) -> TracerProvider:
    """Install the global tracer provider; export over OTLP/gRPC only when configured."""
    global _provider
    if _provider is not None:
        return _provider
    exporting = bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    # With no collector, spans are still created (their trace and span ids name log
    # lines and trajectory steps) but not recorded: recording what nobody exports
    # cost the gateway about a tenth of its per-call CPU (bench/gateway_overhead.py).
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(ALWAYS_ON) if exporting else ALWAYS_OFF,
    )
    if exporting:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and stop exporting; called on graceful shutdown so no span is lost."""
    if _provider is not None:
        _provider.force_flush()
        _provider.shutdown()


@contextmanager
def bound_run(run_id: str) -> Iterator[None]:
    token = current_run_id.set(run_id)
    try:
        yield
    finally:
        current_run_id.reset(token)


def span_id_hex(span: trace.Span) -> str:
    return format(span.get_span_context().span_id, "016x")


def trace_id_hex(span: trace.Span) -> str:
    return format(span.get_span_context().trace_id, "032x")
