"""The one seam between the failover loop and a model vendor.

A provider takes the domain request and the route it is tried under and returns a
Completion (`complete`), or the content deltas of one streamed answer followed by
its Completion (`stream`). Everything a vendor's protocol says (request bodies,
response JSON, server-sent events, error bodies, Retry-After headers) lives behind
it, in one class per protocol the gateway speaks; today that is OpenAI
chat-completions, spoken by every vendor (`openai_compatible.py`). The router
(`router.py`) only orders providers, retries, cools them down and keeps their
ceilings, as pydantic-ai's FallbackModel does over models that own their requests;
like httpx's transport, the seam is small enough that a test can put a scripted
provider behind it and drive the whole loop without a network.

Every way an attempt can fail is an `AttemptFailed` with an Outcome, raised by the
provider at its boundary, so the loop never sees a transport's exception.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Protocol

from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import ChatRequest, Completion, ContentDelta, Outcome, Route


class AttemptFailed(Exception):
    """One attempt against one provider ended without an answer."""

    def __init__(
        self,
        outcome: Outcome,
        detail: str,
        *,
        http_status: int = 0,
        retry_after_seconds: float | None = None,
    ) -> None:
        super().__init__(f"{outcome.value}: {detail}")
        self.outcome = outcome
        self.detail = detail
        self.http_status = http_status
        self.retry_after_seconds = retry_after_seconds


class ChatProvider(Protocol):
    """What the failover loop and the embeddings need from a vendor."""

    config: ProviderConfig

    async def complete(
        self, request: ChatRequest, route: Route, *, timeout_seconds: float
    ) -> Completion:
        """The whole answer, or AttemptFailed. `timeout_seconds` bounds the call."""
        ...

    def stream(
        self, request: ChatRequest, route: Route, *, timeout_seconds: float
    ) -> AsyncGenerator[ContentDelta | Completion, None]:
        """Content as it arrives, then exactly one Completion; or AttemptFailed at
        any point. `timeout_seconds` bounds connecting and each silence."""
        ...

    async def embed(self, texts: Sequence[str], *, model: str) -> list[list[float]]: ...

    async def aclose(self) -> None: ...


def api_key_for(config: ProviderConfig, env: Mapping[str, str]) -> str | None:
    """The key from the variable the config names; "" when none is needed; None when
    the variable is named but unset (the provider cannot be used)."""
    if not config.api_key_env:
        return ""
    value = env.get(config.api_key_env, "").strip()
    return value or None
