"""Calling another cairn service: a traced aio channel, and the metadata that
carries the caller's own token (authorization) and, for an acting service, its
per-run credential (provenance).
"""

from __future__ import annotations

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from cairn_libs.identity import ACTOR_METADATA_KEY, CALLER_METADATA_KEY


def channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        target,
        interceptors=aio_client_interceptors(),  # type: ignore[no-untyped-call]
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
    )


def call_metadata(caller_token: str, *, actor_token: str = "") -> tuple[tuple[str, str], ...]:
    metadata: list[tuple[str, str]] = [(CALLER_METADATA_KEY, f"Bearer {caller_token}")]
    if actor_token:
        metadata.append((ACTOR_METADATA_KEY, f"Bearer {actor_token}"))
    return tuple(metadata)
