"""Calling another cairn service: a traced aio channel, and the metadata that
carries the caller's own token (authorization) and, for an acting service, its
per-run credential (provenance).

Reconnect backoff is capped (CAIRN_GRPC_MAX_RECONNECT_BACKOFF_MS, default one
second). gRPC's own default grows to two minutes, so after a dependency came back
a caller went on reporting it missing for many seconds; between services on one
network a reconnect attempt a second is cheap.

Replicas. A target is what gRPC dials: `host:port` (one address, or every address
its name resolves to), `dns:///name:port` (a headless Service: one address per
replica), `ipv4:a:p,b:p` (fixed addresses, as the local stack starts them), or a
plain comma list `a:p,b:p` of IPv4 addresses, read as `ipv4:`. Every channel
balances round robin over the target's addresses and retries UNAVAILABLE on the
RPCs where that is safe (`cairn_libs.service_config`, which says which and why).
"""

from __future__ import annotations

import ipaddress
import os

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from cairn_libs.errors import ConfigurationError
from cairn_libs.identity import ACTOR_METADATA_KEY, CALLER_METADATA_KEY
from cairn_libs.service_config import service_config_json

MAX_RECONNECT_BACKOFF_ENV = "CAIRN_GRPC_MAX_RECONNECT_BACKOFF_MS"
DEFAULT_MAX_RECONNECT_BACKOFF_MS = 1000
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024


def max_reconnect_backoff_ms() -> int:
    raw = os.environ.get(MAX_RECONNECT_BACKOFF_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_RECONNECT_BACKOFF_MS
    if not raw.isdigit() or int(raw) <= 0:
        raise ConfigurationError(
            f"{MAX_RECONNECT_BACKOFF_ENV}={raw!r} is not a number of milliseconds; "
            "give a whole number above 0"
        )
    return int(raw)


def channel_options(*, max_backoff_ms: int | None = None) -> list[tuple[str, int | str]]:
    """The options of every cairn client channel."""
    cap = max_reconnect_backoff_ms() if max_backoff_ms is None else max_backoff_ms
    first = min(cap, 100)
    return [
        ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.min_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", cap),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config_json()),
    ]


def dial_target(target: str) -> str:
    """The gRPC target for a configured address (see the module docstring); a comma
    list that is not of IPv4 addresses is refused with what to write instead."""
    value = target.strip()
    if "," not in value or value.startswith(("ipv4:", "ipv6:")):
        return value
    addresses = [part.strip() for part in value.split(",")]
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            host = ""
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"{address!r} in the address list {target!r} is not an IPv4 host:port; "
                "list IPv4 addresses (127.0.0.1:50051,127.0.0.1:50061) or give one "
                "dns:///name:port that resolves to every replica"
            )
    return "ipv4:" + ",".join(addresses)


def channel(target: str, *, max_backoff_ms: int | None = None) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        dial_target(target),
        interceptors=aio_client_interceptors(),  # type: ignore[no-untyped-call]
        options=channel_options(max_backoff_ms=max_backoff_ms),
    )


def sync_channel(target: str, *, max_backoff_ms: int | None = None) -> grpc.Channel:
    """A blocking channel with the same balancing and retry policy (CLIs, devstack)."""
    return grpc.insecure_channel(
        dial_target(target), options=channel_options(max_backoff_ms=max_backoff_ms)
    )


def call_metadata(caller_token: str, *, actor_token: str = "") -> tuple[tuple[str, str], ...]:
    metadata: list[tuple[str, str]] = [(CALLER_METADATA_KEY, f"Bearer {caller_token}")]
    if actor_token:
        metadata.append((ACTOR_METADATA_KEY, f"Bearer {actor_token}"))
    return tuple(metadata)
