"""The failover loop: try providers in order, retry where it helps, report every
attempt, do no harm.

The loop speaks to vendors only through the provider seam (`provider.ChatProvider`:
domain request and route in, Completion or content deltas out); it holds ordering,
retries, cooldowns, ceilings, budgets and instrumentation, and no vendor's JSON.

For each call: plan the routes, reserve the run's budget, then per provider skip it
if it is cooling down, take from its ceiling, send, and let
`resilience.after_attempt` say whether to answer, retry the same provider after a
wait, fail over or return the error. Each attempt sent is one `chat {model}` span
and one entry in the response's attempts; so is each skip. Unary and streamed calls
share this loop; a stream forwards content as it arrives and, once any has been
sent, can only finish or fail, never start over.

A cooldown this replica begins is shared at once (`SharedCooldowns`), and
`adopt_shared_cooldowns`, called periodically by the app, takes on the ones other
replicas began (see resilience.py).

The caller's gRPC deadline bounds the whole call: no retry is begun whose wait
would outlast it, and no attempt is given longer than what is left of it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import (
    Attempt,
    ChatRequest,
    ChatResult,
    Completion,
    ContentDelta,
    CooldownCause,
    NextStep,
    Outcome,
    RequestShape,
    Route,
    UnusableProvider,
    all_failed_error,
    error_for_attempt,
    plan_routes,
    reasoning_effort_for,
    tokens_needed,
)
from cairn_gateway.errors import CooldownsUnavailable, NoUsableProvider
from cairn_gateway.instrumentation import request_attributes, result_attributes, span_name
from cairn_gateway.ledger import CeilingGrant, Ledger
from cairn_gateway.provider import AttemptFailed, ChatProvider
from cairn_gateway.resilience import (
    CooldownBoard,
    Cooling,
    SharedCooldowns,
    UnsharedCooldowns,
    after_attempt,
)

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)

# Failures after which the vendor may have spent tokens we cannot count.
_USAGE_UNKNOWN = frozenset({Outcome.TIMEOUT, Outcome.STREAM_CUT, Outcome.MALFORMED_RESPONSE})
# An attempt is never given less than this, so a nearly spent deadline still gets
# a real try (and a TIMEOUT attempt to report) rather than a zero timeout.
_MIN_ATTEMPT_SECONDS = 0.05
# Sharing a cooldown never holds a call up for longer than this.
_SHARE_TIMEOUT_SECONDS = 1.0


@dataclass
class _AttemptRecord:
    attempt: Attempt | None = None
    completion: Completion | None = None
    # An answering attempt's grant, settled as the call ends (with the release).
    unsettled: CeilingGrant | None = None


class Router:
    def __init__(
        self,
        providers: Sequence[ChatProvider],
        *,
        ledger: Ledger,
        trace_content: bool = False,
        unusable: Sequence[UnusableProvider] = (),
        cooldowns: CooldownBoard | None = None,
        shared_cooldowns: SharedCooldowns | None = None,
        jitter: random.Random | None = None,
    ) -> None:
        self._providers = {p.config.name: p for p in providers}
        self._configs = tuple(p.config for p in providers)
        self._ledger = ledger
        self._trace_content = trace_content
        # Providers left out at start-up, with why (e.g. their key variable is unset):
        # a request only they could serve is told so, as the deployment's mistake.
        self._unusable = tuple(unusable)
        self._cooldowns = cooldowns or CooldownBoard()
        self._shared = shared_cooldowns or UnsharedCooldowns()
        self._jitter = jitter or random.Random()

    @property
    def configs(self) -> tuple[ProviderConfig, ...]:
        return self._configs

    async def adopt_shared_cooldowns(self) -> None:
        """Take on the cooldowns other replicas began that end later than ours;
        raises CooldownsUnavailable when the shared ones cannot be read."""
        for shared in await self._shared.running():
            provider = self._providers.get(shared.provider)
            if provider is None or provider.config.base_url != shared.base_url:
                continue
            if self._cooldowns.adopt(provider.config, shared.seconds_left, shared.cause):
                log.warning(
                    "provider.cooldown_adopted",
                    provider=shared.provider,
                    seconds=round(shared.seconds_left, 3),
                    cause=shared.cause.value if shared.cause else None,
                )

    async def chat(
        self, request: ChatRequest, *, org_id: str, time_limit: float | None = None
    ) -> ChatResult:
        async with aclosing(
            self._run(request, org_id=org_id, stream=False, time_limit=time_limit)
        ) as events:
            async for event in events:
                if isinstance(event, ChatResult):
                    return event
        raise AssertionError("the failover loop ended without a result or an error")

    def chat_stream(
        self, request: ChatRequest, *, org_id: str, time_limit: float | None = None
    ) -> AsyncIterator[ContentDelta | ChatResult]:
        return self._run(request, org_id=org_id, stream=True, time_limit=time_limit)

    async def _run(
        self, request: ChatRequest, *, org_id: str, stream: bool, time_limit: float | None
    ) -> AsyncGenerator[ContentDelta | ChatResult, None]:
        if not self._providers:
            reasons = "; ".join(f"{u.config.name!r}: {u.reason}" for u in self._unusable)
            raise NoUsableProvider(
                f"no model provider is usable ({reasons or 'none configured'}); "
                "the deployment must fix that"
            )
        deadline = None if time_limit is None else time.monotonic() + time_limit
        routes = plan_routes(self._configs, request, unusable=self._unusable)
        # The run's reservation and the first provider's ceiling in one step; a
        # provider cooling down is not asked (its turn will be a skip).
        first = self._providers[routes[0].provider].config
        reservation, taken = await self._ledger.begin_call(
            org_id=org_id,
            request=request,
            provider=first if self._cooldowns.cooling(first.name) is None else None,
            tokens=tokens_needed(request),
        )
        try:
            attempts: list[Attempt] = []
            content_sent = False
            for index, route in enumerate(routes):
                provider = self._providers[route.provider]
                retries = 0
                while True:
                    skipped = self._skip_if_cooling(provider.config, route, request)
                    record = _AttemptRecord(attempt=skipped)
                    pretaken, taken = taken, None
                    if skipped is not None and pretaken is not None:
                        # It began cooling while its ceiling was taken: give that back.
                        await self._ledger.settle_ceiling(pretaken, 0)
                    if skipped is None:
                        async with aclosing(
                            self._attempt(
                                provider,
                                route,
                                request,
                                stream,
                                record,
                                timeout_seconds=_attempt_timeout(provider.config, deadline),
                                retry_number=retries,
                                pretaken=pretaken,
                            )
                        ) as deltas:
                            async for delta in deltas:
                                content_sent = True
                                yield delta
                    attempt = record.attempt
                    assert attempt is not None
                    attempts.append(attempt)
                    decision = after_attempt(
                        attempt,
                        RequestShape(
                            has_tool_history=request.has_tool_history, content_sent=content_sent
                        ),
                        retries_done=retries,
                        policy=provider.config.retry,
                        time_left=None if deadline is None else deadline - time.monotonic(),
                        failover_possible=attempt.outcome is not Outcome.OK
                        and any(
                            self._cooldowns.cooling(later.provider) is None
                            for later in routes[index + 1 :]
                        ),
                        jitter=self._jitter.random(),
                    )
                    if record.unsettled is not None and decision.step is not NextStep.ANSWER:
                        await self._ledger.settle_ceiling(
                            record.unsettled, self._tokens_used(record, record.unsettled)
                        )
                    if decision.step is NextStep.ANSWER:
                        assert record.completion is not None
                        # The call has used what it will use: settle and release in
                        # one step, before the answer leaves.
                        finished, reservation = reservation, None
                        await self._ledger.finish_call(
                            finished,
                            record.unsettled,
                            record.completion.usage.total_tokens,
                        )
                        yield ChatResult(record.completion, route.provider, tuple(attempts))
                        return
                    if decision.step is NextStep.RETURN_ERROR:
                        raise error_for_attempt(
                            attempt, content_sent=content_sent, earlier=attempts[:-1]
                        )
                    if decision.step is NextStep.FAIL_OVER:
                        break
                    retries += 1
                    cooling = self._cooldowns.cooling(route.provider)
                    # A provider this very failure put into a long cooldown is not
                    # waited for: the next turn of the loop records the skip.
                    if cooling is None or cooling.seconds_left <= decision.delay_seconds:
                        await asyncio.sleep(decision.delay_seconds)
            raise all_failed_error(attempts)
        finally:
            if reservation is not None:
                await self._ledger.release_run(reservation)

    def _skip_if_cooling(
        self, config: ProviderConfig, route: Route, request: ChatRequest
    ) -> Attempt | None:
        cooling = self._cooldowns.cooling(config.name)
        if cooling is None:
            return None
        why = (
            "it asked to wait (Retry-After)"
            if cooling.cause is CooldownCause.RATE_LIMIT
            else "it failed repeatedly"
        )
        attempt = Attempt(
            provider=config.name,
            model=route.model,
            outcome=Outcome.SKIPPED_COOLDOWN,
            detail=f"cooling down for {cooling.seconds_left:.1f}s more: {why}",
            retry_after_seconds=cooling.seconds_left,
            cooldown_cause=cooling.cause,
        )
        self._log_attempt(attempt, request)
        return attempt

    async def _attempt(
        self,
        provider: ChatProvider,
        route: Route,
        request: ChatRequest,
        stream: bool,
        record: _AttemptRecord,
        *,
        timeout_seconds: float,
        retry_number: int,
        pretaken: CeilingGrant | None = None,
    ) -> AsyncGenerator[ContentDelta, None]:
        """One try against one provider; fills `record` with the attempt (and the
        completion on success) instead of raising for a provider failure."""
        config = provider.config
        # For the span; the provider puts it in its own request.
        effort = reasoning_effort_for(config, route.tier)
        # Not made current: this generator yields to the servicer mid-span, and a
        # context attached across a yield would leak into the caller's code.
        span = tracer.start_span(span_name(route), kind=SpanKind.CLIENT)
        # Attributes only for a span that is kept: with no collector configured
        # nothing records them, and building them was measurable per call.
        if span.is_recording():
            span.set_attributes(
                request_attributes(
                    route,
                    config,
                    request,
                    reasoning_effort=effort,
                    trace_content=self._trace_content,
                    retry_number=retry_number,
                )
            )
        started = time.perf_counter()
        grant = pretaken
        try:
            if grant is None:
                grant = await self._ledger.take_ceiling(config, tokens_needed(request))
            if grant is not None and not grant.granted:
                raise AttemptFailed(
                    Outcome.REFUSED_CEILING,
                    grant.detail,
                    retry_after_seconds=grant.retry_after_seconds,
                )
            if stream:
                completion = None
                async with aclosing(
                    provider.stream(request, route, timeout_seconds=timeout_seconds)
                ) as events:
                    async for event in events:
                        if isinstance(event, Completion):
                            completion = event
                        else:
                            yield event
                if completion is None:
                    raise AssertionError(
                        f"provider {config.name!r} ended a stream without a completion"
                    )
            else:
                completion = await provider.complete(
                    request, route, timeout_seconds=timeout_seconds
                )
            record.completion = completion
            record.attempt = Attempt(
                provider=config.name,
                model=route.model,
                outcome=Outcome.OK,
                http_status=200,
                latency_seconds=time.perf_counter() - started,
                detail="usage estimated: the provider reported none"
                if completion.usage_estimated
                else "",
            )
        except AttemptFailed as failure:
            record.attempt = Attempt(
                provider=config.name,
                model=route.model,
                outcome=failure.outcome,
                http_status=failure.http_status,
                latency_seconds=time.perf_counter() - started,
                detail=failure.detail,
                retry_after_seconds=failure.retry_after_seconds,
            )
        finally:
            if record.attempt is not None:
                await self._note_health(config, record.attempt)
            if grant is not None and grant.granted:
                if record.completion is not None and record.attempt is not None:
                    record.unsettled = grant
                else:
                    await self._ledger.settle_ceiling(grant, self._tokens_used(record, grant))
            self._finish_span(span, record, request)

    async def _note_health(self, config: ProviderConfig, attempt: Attempt) -> None:
        cooling = self._cooldowns.record(
            config, attempt.outcome, retry_after=attempt.retry_after_seconds
        )
        if cooling is not None:
            log.warning(
                "provider.cooldown",
                provider=config.name,
                seconds=round(cooling.seconds_left, 3),
                cause=cooling.cause.value if cooling.cause else None,
            )
            await self._share(config, cooling)

    async def _share(self, provider: ProviderConfig, cooling: Cooling) -> None:
        try:
            async with asyncio.timeout(_SHARE_TIMEOUT_SECONDS):
                await self._shared.share(provider, cooling)
        except (CooldownsUnavailable, TimeoutError) as exc:
            # Kept here all the same; the other replicas learn it by failing.
            log.warning("provider.cooldown_not_shared", provider=provider.name, error=str(exc))

    @staticmethod
    def _tokens_used(record: _AttemptRecord, grant: CeilingGrant) -> int:
        if record.completion is not None:
            return record.completion.usage.total_tokens
        if record.attempt is None or record.attempt.outcome in _USAGE_UNKNOWN:
            return grant.tokens
        return 0

    def _finish_span(self, span: trace.Span, record: _AttemptRecord, request: ChatRequest) -> None:
        attempt = record.attempt
        if attempt is None:
            # Cancelled (the caller went away) or a bug: no outcome to report.
            span.set_status(Status(StatusCode.ERROR, "attempt did not finish"))
            span.end()
            return
        if span.is_recording():
            span.set_attributes(
                result_attributes(attempt, record.completion, trace_content=self._trace_content)
            )
            if attempt.outcome is not Outcome.OK:
                span.set_status(Status(StatusCode.ERROR, attempt.outcome.value))
        span.end()
        self._log_attempt(attempt, request)

    @staticmethod
    def _log_attempt(attempt: Attempt, request: ChatRequest) -> None:
        log.info(
            "chat.attempt",
            provider=attempt.provider,
            model=attempt.model,
            outcome=attempt.outcome.value,
            http_status=attempt.http_status,
            latency_ms=round(attempt.latency_seconds * 1000, 2),
            run_id=request.run_id or None,
            # A vendor's words about a rejected request may quote it; keep them out.
            detail=None if attempt.outcome is Outcome.CLIENT_ERROR else attempt.detail or None,
        )


def _attempt_timeout(config: ProviderConfig, deadline: float | None) -> float:
    if deadline is None:
        return config.timeout_seconds
    return max(_MIN_ATTEMPT_SECONDS, min(config.timeout_seconds, deadline - time.monotonic()))
