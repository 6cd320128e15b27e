"""The REST proxy process for the cross-service REST tests: built from
services/restproxy, started in front of the session's stack, exporting its spans
to the session's OTLP receiver, and stopped afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cairn_libs.stack import build_restproxy, free_port, start_restproxy, wait_for_http
from tests.conftest import Stack


@contextmanager
def running_restproxy(stack: Stack, *, otlp_endpoint: str, log_dir: Path) -> Iterator[str]:
    """Yield the proxy's base URL (http://127.0.0.1:PORT) once it listens."""
    build_restproxy()
    port = free_port()
    proxy = start_restproxy(
        port=port,
        addresses=stack.addresses,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"},
        log_dir=log_dir,
    )
    try:
        wait_for_http(proxy)
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.stop()
