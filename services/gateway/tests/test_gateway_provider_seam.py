"""The provider seam: the failover loop drives any provider that takes the domain
request and a route, with no HTTP and no vendor JSON between them. A scripted
provider stands behind the seam here, as httpx's MockTransport stands behind its
transport; the real one is tested over HTTP against the fake vendors."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import pytest

from cairn_gateway.config import CooldownPolicy, ProviderConfig, RetryPolicy
from cairn_gateway.domain import (
    ChatMessage,
    ChatRequest,
    ChatResult,
    Completion,
    ContentDelta,
    Outcome,
    Route,
    Usage,
)
from cairn_gateway.errors import ProviderUnavailable
from cairn_gateway.ledger import NoLedger
from cairn_gateway.provider import AttemptFailed
from cairn_gateway.router import Router


def answer(text: str, *, model: str) -> Completion:
    return Completion(
        message=ChatMessage(role="assistant", content=text),
        finish_reason="stop",
        usage=Usage(3, 2, 5),
        model=model,
    )


@dataclass
class ScriptedProvider:
    """Answers with `reply`, or fails with `failure`; notes what it was asked."""

    config: ProviderConfig
    reply: Sequence[str] = ("ok",)
    failure: AttemptFailed | None = None
    asked: list[tuple[ChatRequest, Route, bool]] = field(default_factory=list)

    async def complete(
        self, request: ChatRequest, route: Route, *, timeout_seconds: float
    ) -> Completion:
        self.asked.append((request, route, False))
        if self.failure is not None:
            raise self.failure
        return answer("".join(self.reply), model=route.model)

    async def stream(
        self, request: ChatRequest, route: Route, *, timeout_seconds: float
    ) -> AsyncGenerator[ContentDelta | Completion, None]:
        self.asked.append((request, route, True))
        if self.failure is not None:
            raise self.failure
        for piece in self.reply:
            yield ContentDelta(piece)
        yield answer("".join(self.reply), model=route.model)

    async def embed(self, texts: Sequence[str], *, model: str) -> list[list[float]]:
        return [[0.0] for _ in texts]

    async def aclose(self) -> None:
        return None


def config(name: str) -> ProviderConfig:
    return ProviderConfig(
        name=name,
        base_url=f"http://{name}.invalid/v1",
        api_key_env="",
        models={"balanced": f"{name}-balanced"},
        supports_reasoning_effort=name == "first",
        retry=RetryPolicy(max_retries=0),
        cooldown=CooldownPolicy(max_seconds=0),
    )


REQUEST = ChatRequest(messages=(ChatMessage(role="user", content="Capital of France?"),))


async def test_router_hands_each_provider_the_domain_request_and_its_route() -> None:
    first = ScriptedProvider(config("first"))
    router = Router([first], ledger=NoLedger())

    result = await router.chat(REQUEST, org_id="org-1")

    assert result.completion.message.content == "ok"
    assert first.asked == [(REQUEST, Route("first", "first-balanced", "balanced"), False)]


async def test_router_fails_over_on_an_attempt_failure_raised_behind_the_seam() -> None:
    first = ScriptedProvider(
        config("first"), failure=AttemptFailed(Outcome.SERVER_ERROR, "HTTP 500: boom")
    )
    second = ScriptedProvider(config("second"), reply=("Paris",))
    router = Router([first, second], ledger=NoLedger())

    result = await router.chat(REQUEST, org_id="org-1")

    assert result.provider == "second"
    assert result.completion.message.content == "Paris"
    assert [(a.provider, a.outcome, a.detail) for a in result.attempts] == [
        ("first", Outcome.SERVER_ERROR, "HTTP 500: boom"),
        ("second", Outcome.OK, ""),
    ]


async def test_router_forwards_streamed_deltas_and_answers_with_the_providers_completion() -> None:
    first = ScriptedProvider(config("first"), reply=("Par", "is"))
    router = Router([first], ledger=NoLedger())

    events = [event async for event in router.chat_stream(REQUEST, org_id="org-1")]

    assert events[:2] == [ContentDelta("Par"), ContentDelta("is")]
    done = events[-1]
    assert isinstance(done, ChatResult)
    assert done.completion.message.content == "Paris"
    assert first.asked[0][2] is True


async def test_router_reports_every_failure_behind_the_seam_when_none_answers() -> None:
    failing = [
        ScriptedProvider(config(name), failure=AttemptFailed(Outcome.TIMEOUT, "no answer"))
        for name in ("first", "second")
    ]
    router = Router(failing, ledger=NoLedger())

    with pytest.raises(ProviderUnavailable, match="all 2 provider attempt"):
        await router.chat(REQUEST, org_id="org-1")
