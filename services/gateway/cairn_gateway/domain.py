"""What a model call is, and the decisions about it that need no network.

Which providers to try for a request (`plan_routes`), whether a run budget can hold
it (`check_run_budget`), whether another provider may take over after an attempt
fails (`next_step`), and which error a caller gets (`error_for_attempt`,
`all_failed_error`) are pure functions here, so the failover rules can be tested as
a table; retries and cooldowns build on them in `resilience.py`, and the loop in
`router.py` only does the I/O they decide on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from cairn_gateway.config import TIERS, ProviderConfig, Tier
from cairn_gateway.errors import (
    CallExceedsCeiling,
    ChatRequestInvalid,
    GatewayError,
    NoUsableProvider,
    ProviderCredentialRejected,
    ProviderRateLimited,
    ProviderRejectedRequest,
    ProviderUnavailable,
    RunBudgetExceeded,
    StreamCut,
)
from cairn_libs.token_estimate import tokens_for_chars

Role = Literal["system", "user", "assistant", "tool"]
ReasoningEffort = Literal["low", "medium", "high"]

DEFAULT_TIER: Tier = "balanced"
DEFAULT_MAX_TOKENS = 1024
# A provider that says 429 without Retry-After: the caller still gets a delay.
DEFAULT_RETRY_AFTER_SECONDS = 1.0

# Fixed in code so that "deep" means the same on every deployment.
REASONING_EFFORT: Mapping[Tier, ReasoningEffort] = {
    "fast": "low",
    "balanced": "medium",
    "deep": "high",
}


class Outcome(StrEnum):
    OK = "OK"
    RATE_LIMITED = "RATE_LIMITED"
    SERVER_ERROR = "SERVER_ERROR"
    TIMEOUT = "TIMEOUT"
    CONNECTION_ERROR = "CONNECTION_ERROR"
    CLIENT_ERROR = "CLIENT_ERROR"
    MALFORMED_RESPONSE = "MALFORMED_RESPONSE"
    STREAM_CUT = "STREAM_CUT"
    SKIPPED_COOLDOWN = "SKIPPED_COOLDOWN"
    REFUSED_CEILING = "REFUSED_CEILING"


class CooldownCause(StrEnum):
    # The provider asked to be left alone (Retry-After on a 429 or 503).
    RATE_LIMIT = "RATE_LIMIT"
    # It failed several times in a row.
    FAILURES = "FAILURES"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    # Exactly as the model produced it: never parsed and re-serialised.
    arguments_json: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    name: str
    description: str
    parameters: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolDefinition, ...] = ()
    tier: Tier | None = None
    model: str = ""
    max_tokens: int | None = None
    run_id: str = ""
    remaining_budget_tokens: int | None = None
    temperature: float | None = None
    pinned_provider: str = ""

    @property
    def has_tool_history(self) -> bool:
        """A tool call or tool result in the conversation: it may carry metadata
        (ids, signatures) only the provider that made it understands."""
        return any(m.tool_calls or m.role == "tool" for m in self.messages)

    @property
    def output_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


@dataclass(frozen=True, slots=True)
class Route:
    """One provider to try, with the model and tier it serves the request under."""

    provider: str
    model: str
    tier: Tier


@dataclass(frozen=True, slots=True)
class Completion:
    """What one provider answered."""

    message: ChatMessage
    finish_reason: str
    usage: Usage
    # The model the provider says answered (may be a dated version of the one asked).
    model: str
    usage_estimated: bool = False


@dataclass(frozen=True, slots=True)
class Attempt:
    provider: str
    model: str
    outcome: Outcome
    http_status: int = 0
    latency_seconds: float = 0.0
    # Why it ended so; never a key or prompt text.
    detail: str = ""
    retry_after_seconds: float | None = None
    # For SKIPPED_COOLDOWN: why the provider is cooling down.
    cooldown_cause: CooldownCause | None = None


@dataclass(frozen=True, slots=True)
class ChatResult:
    completion: Completion
    provider: str
    attempts: tuple[Attempt, ...]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ModelListing:
    provider: str
    model: str
    tiers: tuple[Tier, ...]
    offline_demo: bool


# --- routing ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnusableProvider:
    """A configured provider this gateway cannot use, and why (e.g. its key variable
    is unset). Kept next to the usable ones so that a request only it could serve is
    told about the deployment's mistake rather than that its model does not exist."""

    config: ProviderConfig
    reason: str


def plan_routes(
    providers: Sequence[ProviderConfig],
    request: ChatRequest,
    *,
    unusable: Sequence[UnusableProvider] = (),
) -> list[Route]:
    """The providers to try, in configured order. An explicit model wins over a tier
    and is tried on every provider that lists it.

    A model no provider lists is the caller's mistake (INVALID_ARGUMENT, naming the
    models there are). A model or tier that only unusable providers serve, or a tier
    no provider serves, is the deployment's (FAILED_PRECONDITION, naming the tier or
    model and why): the caller asked for something the API offers."""
    if request.model:
        routes = []
        for provider in providers:
            tiers = provider.tiers_of(request.model)
            if tiers:
                routes.append(Route(provider.name, request.model, request.tier or tiers[0]))
        if not routes:
            blocked = [u for u in unusable if u.config.tiers_of(request.model)]
            if blocked:
                raise NoUsableProvider(
                    f"model {request.model!r} is configured only on provider(s) this gateway "
                    f"cannot use: {_why_unusable(blocked)}; the deployment must fix that"
                )
            known = sorted({m for p in providers for m in p.chat_models})
            raise ChatRequestInvalid(
                f"model {request.model!r} is not configured on any provider; configured "
                f"models: {', '.join(known) or 'none'} (or leave model empty and choose a tier)"
            )
        return _pin(routes, request)
    tier = request.tier or DEFAULT_TIER
    routes = [
        Route(p.name, model, tier) for p in providers if (model := p.model_for(tier)) is not None
    ]
    if not routes:
        blocked = [u for u in unusable if u.config.model_for(tier) is not None]
        if blocked:
            raise NoUsableProvider(
                f"no usable provider serves tier {tier!r}: {_why_unusable(blocked)}; "
                "the deployment must fix that"
            )
        served = sorted({t for p in providers for t in p.models}, key=TIERS.index)
        raise NoUsableProvider(
            f"this deployment has no provider for tier {tier!r}; tiers served: "
            f"{', '.join(served) or 'none'} (ask for one of those, or the deployment adds "
            f"a {tier} model to a provider)"
        )
    return _pin(routes, request)


def _why_unusable(unusable: Sequence[UnusableProvider]) -> str:
    return "; ".join(f"{u.config.name!r}: {u.reason}" for u in unusable)


def _pin(routes: list[Route], request: ChatRequest) -> list[Route]:
    """A conversation holding tool calls goes only to the provider that made them."""
    if not (request.pinned_provider and request.has_tool_history):
        return routes
    pinned = [r for r in routes if r.provider == request.pinned_provider]
    if not pinned:
        raise ChatRequestInvalid(
            f"pinned_provider {request.pinned_provider!r} made the tool calls in this "
            f"conversation but serves none of the requested models here; configured providers: "
            f"{', '.join(sorted({r.provider for r in routes})) or 'none'}"
        )
    return pinned


def reasoning_effort_for(provider: ProviderConfig, tier: Tier) -> ReasoningEffort | None:
    """The effort a tier asks of a provider that takes one; None for one that does not."""
    return REASONING_EFFORT[tier] if provider.supports_reasoning_effort else None


def list_models(providers: Sequence[ProviderConfig]) -> list[ModelListing]:
    return [
        ModelListing(p.name, model, p.tiers_of(model), p.offline_demo)
        for p in providers
        for model in p.chat_models
    ]


# --- budgets ---------------------------------------------------------------------


def estimate_prompt_tokens(
    messages: Sequence[ChatMessage], tools: Sequence[ToolDefinition] = ()
) -> int:
    """The shared characters/4 estimate (cairn_libs.token_estimate) over everything
    the provider will read, tool schemas included."""
    chars = 0
    for message in messages:
        chars += len(message.content) + len(message.name)
        for call in message.tool_calls:
            chars += len(call.name) + len(call.arguments_json)
    for tool in tools:
        chars += len(tool.name) + len(tool.description) + len(repr(tool.parameters))
    return tokens_for_chars(chars)


def tokens_needed(request: ChatRequest) -> int:
    """The most a call can consume: prompt estimate plus the output it may produce."""
    return estimate_prompt_tokens(request.messages, request.tools) + request.output_tokens


def check_run_budget(request: ChatRequest, *, reserved_in_flight: int = 0) -> int:
    """Refuse a call that cannot fit the run's remaining budget; return what it needs."""
    needed = tokens_needed(request)
    remaining = request.remaining_budget_tokens
    if remaining is None:
        return needed
    if needed + reserved_in_flight > remaining:
        in_flight = (
            f" while {reserved_in_flight} are reserved by calls of this run in flight"
            if reserved_in_flight
            else ""
        )
        whose = f"run {request.run_id!r}" if request.run_id else "this call's budget"
        raise RunBudgetExceeded(
            f"{whose} has {remaining} tokens left, and this call may use "
            f"{needed} (about {needed - request.output_tokens} prompt + max_tokens "
            f"{request.output_tokens}){in_flight}; lower max_tokens, shorten the "
            "conversation, or raise the run's budget"
        )
    return needed


# --- failover --------------------------------------------------------------------


class NextStep(StrEnum):
    ANSWER = "ANSWER"
    FAIL_OVER = "FAIL_OVER"
    RETURN_ERROR = "RETURN_ERROR"
    # Same provider again after a wait; decided by resilience.after_attempt, which
    # builds on next_step (next_step itself never returns it).
    RETRY = "RETRY"


@dataclass(frozen=True, slots=True)
class RequestShape:
    has_tool_history: bool = False
    # Streaming only: some content already reached the caller.
    content_sent: bool = False


# Failures that say nothing about the request, so another provider may well succeed.
RETRYABLE: frozenset[Outcome] = frozenset(
    {
        Outcome.RATE_LIMITED,
        Outcome.SERVER_ERROR,
        Outcome.TIMEOUT,
        Outcome.CONNECTION_ERROR,
        Outcome.MALFORMED_RESPONSE,
        Outcome.STREAM_CUT,
        Outcome.SKIPPED_COOLDOWN,
        Outcome.REFUSED_CEILING,
    }
)


def next_step(outcome: Outcome, shape: RequestShape) -> NextStep:
    """After one attempt: answer, try the next provider, or return this error.

    Failover never does harm: not for an error that would fail the same way
    anywhere (CLIENT_ERROR: invalid request, rejected credential), not when the
    conversation carries tool calls another provider cannot continue, and not once
    the caller has seen part of an answer it could not take back.
    """
    if outcome is Outcome.OK:
        return NextStep.ANSWER
    if outcome not in RETRYABLE:
        return NextStep.RETURN_ERROR
    if shape.content_sent or shape.has_tool_history:
        return NextStep.RETURN_ERROR
    return NextStep.FAIL_OVER


def outcome_for_status(http_status: int) -> Outcome:
    if http_status == 429:
        return Outcome.RATE_LIMITED
    if http_status == 408:
        return Outcome.TIMEOUT
    if http_status >= 500:
        return Outcome.SERVER_ERROR
    return Outcome.CLIENT_ERROR


def error_for_attempt(
    attempt: Attempt, *, content_sent: bool = False, earlier: Sequence[Attempt] = ()
) -> GatewayError:
    """The error a caller gets when this attempt's failure is returned as is; earlier
    attempts (failed over before this one) are listed after it."""
    error = _error_for_attempt(attempt, content_sent=content_sent)
    if not earlier:
        return error
    listed = "; ".join(describe_attempt(a) for a in earlier)
    return type(error)(
        f"{error.message}; earlier attempts: {listed}",
        retry_after_seconds=error.retry_after_seconds,
    )


def _error_for_attempt(attempt: Attempt, *, content_sent: bool) -> GatewayError:
    where = f"provider {attempt.provider!r} (model {attempt.model!r})"
    if content_sent:
        return StreamCut(
            f"stream from provider {attempt.provider!r} cut after content was sent "
            f"({attempt.outcome.value}: {attempt.detail}); the partial answer is incomplete"
        )
    if attempt.outcome is Outcome.REFUSED_CEILING and attempt.retry_after_seconds is None:
        return CallExceedsCeiling(
            f"{where} cannot take this call at all ({attempt.detail}); lower max_tokens "
            "or shorten the conversation"
        )
    if attempt.outcome is Outcome.SKIPPED_COOLDOWN:
        # A cooldown begun by the provider's own Retry-After is a rate limit still running.
        error_type = (
            ProviderRateLimited
            if attempt.cooldown_cause is CooldownCause.RATE_LIMIT
            else ProviderUnavailable
        )
        return error_type(
            f"{where} was not tried: {attempt.detail}",
            retry_after_seconds=attempt.retry_after_seconds,
        )
    if attempt.outcome in (Outcome.RATE_LIMITED, Outcome.REFUSED_CEILING):
        retry_after = attempt.retry_after_seconds or DEFAULT_RETRY_AFTER_SECONDS
        return ProviderRateLimited(
            f"{where} is rate limited ({attempt.detail}); retry after {retry_after:g}s",
            retry_after_seconds=retry_after,
        )
    if attempt.outcome is Outcome.CLIENT_ERROR:
        if attempt.http_status in (401, 403):
            return ProviderCredentialRejected(
                f"{where} refused the deployment's credential (HTTP {attempt.http_status}); "
                "the gateway's key for it needs fixing, not the request"
            )
        return ProviderRejectedRequest(
            f"{where} rejected the request (HTTP {attempt.http_status}): {attempt.detail}"
        )
    return ProviderUnavailable(f"{where} failed: {attempt.outcome.value}: {attempt.detail}")


def all_failed_error(attempts: Sequence[Attempt]) -> GatewayError:
    """Every provider was tried and none answered: list what happened to each."""
    listed = "; ".join(describe_attempt(a) for a in attempts)
    message = f"all {len(attempts)} provider attempt(s) failed: {listed}"
    if attempts and all(
        a.outcome is Outcome.REFUSED_CEILING and a.retry_after_seconds is None for a in attempts
    ):
        return CallExceedsCeiling(f"{message}; lower max_tokens or shorten the conversation")
    if attempts and all(_is_rate_limit(a) for a in attempts):
        soonest = min(a.retry_after_seconds or DEFAULT_RETRY_AFTER_SECONDS for a in attempts)
        return ProviderRateLimited(message, retry_after_seconds=soonest)
    waits = [a.retry_after_seconds for a in attempts if a.retry_after_seconds is not None]
    # Only when every provider said when it would be back is there a time to retry at.
    back_at = min(waits) if attempts and len(waits) == len(attempts) else None
    return ProviderUnavailable(message, retry_after_seconds=back_at)


def _is_rate_limit(attempt: Attempt) -> bool:
    if attempt.outcome is Outcome.SKIPPED_COOLDOWN:
        return attempt.cooldown_cause is CooldownCause.RATE_LIMIT
    if attempt.outcome is Outcome.REFUSED_CEILING:
        return attempt.retry_after_seconds is not None
    return attempt.outcome is Outcome.RATE_LIMITED


def describe_attempt(attempt: Attempt) -> str:
    status = f" HTTP {attempt.http_status}" if attempt.http_status else ""
    detail = f" ({attempt.detail})" if attempt.detail else ""
    return f"{attempt.provider} [{attempt.model}]: {attempt.outcome.value}{status}{detail}"


# --- redaction -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Redactor:
    """Removes secrets, echoed prompt text and U+0000 from provider-supplied text
    before it becomes an attempt detail or an error message.

    Vendors quote requests back in their errors, whole or in part ("Invalid value:
    'Draft the letter for...'"), so any run of `ECHO_MIN_CHARS` or more characters
    that also occurs in the conversation is cut out, wherever it starts. Shorter runs
    are left: they would blank out the ordinary words of an error.
    """

    secrets: tuple[str, ...] = ()
    prompt_texts: tuple[str, ...] = field(default=())
    max_chars: int = 300

    def __call__(self, text: str) -> str:
        # U+0000 in a vendor's words would follow the error into a run's stored steps,
        # which PostgreSQL refuses; it is never meaningful in an error message.
        text = text.replace("\x00", "\ufffd")
        for secret in self.secrets:
            if secret:
                text = text.replace(secret, "[redacted]")
        # Cut before searching, so a huge body costs no more than a short one; the
        # margin keeps an echo that straddles the final cut recognisable.
        text = text[: self.max_chars * 2]
        if self.prompt_texts:
            text = _without_echoes(text, "\x00".join(self.prompt_texts))
        return text if len(text) <= self.max_chars else text[: self.max_chars - 3] + "..."

    def with_prompt(self, messages: Sequence[ChatMessage]) -> Redactor:
        texts = tuple(m.content for m in messages) + tuple(
            c.arguments_json for m in messages for c in m.tool_calls
        )
        return Redactor(self.secrets, texts, self.max_chars)


ECHO_MIN_CHARS = 12


def _without_echoes(text: str, conversation: str) -> str:
    covered = [False] * len(text)
    for start in range(len(text) - ECHO_MIN_CHARS + 1):
        if text[start : start + ECHO_MIN_CHARS] in conversation:
            covered[start : start + ECHO_MIN_CHARS] = [True] * ECHO_MIN_CHARS
    if not any(covered):
        return text
    kept: list[str] = []
    for index, char in enumerate(text):
        if not covered[index]:
            kept.append(char)
        elif index == 0 or not covered[index - 1]:
            kept.append("[prompt]")
    return "".join(kept)


# --- ceilings --------------------------------------------------------------------

# Usage is counted in 10-second buckets. A check counts every bucket that overlaps
# the last 60 seconds plus a send allowance, i.e. at least the last 65 seconds and
# at most 75: a grant is counted at the gateway a moment before the vendor counts the
# request it allowed, and a window shorter than the vendor's sliding minute by that
# moment would let two bursts straddle a bucket boundary and pass a ceiling set to
# the vendor's own limit. The allowance is far more than the database round trip and
# connection set-up between the two; see the property test of the ceiling.
CEILING_BUCKET_SECONDS = 10
CEILING_WINDOW_SECONDS = 60
CEILING_SEND_ALLOWANCE_SECONDS = 5


def ceiling_bucket(epoch_seconds: float) -> int:
    """The start (epoch seconds) of the bucket a moment falls in."""
    return int(epoch_seconds // CEILING_BUCKET_SECONDS) * CEILING_BUCKET_SECONDS


def ceiling_window_floor(epoch_seconds: float) -> int:
    """The oldest bucket start a check at this moment counts."""
    return ceiling_bucket(epoch_seconds - CEILING_WINDOW_SECONDS - CEILING_SEND_ALLOWANCE_SECONDS)


def ceiling_room_returns_in(epoch_seconds: float) -> float:
    """Seconds until the oldest counted bucket leaves the window (a retry hint)."""
    floor = ceiling_window_floor(epoch_seconds)
    leaves_at = (
        floor + CEILING_BUCKET_SECONDS + CEILING_WINDOW_SECONDS + CEILING_SEND_ALLOWANCE_SECONDS
    )
    return leaves_at - epoch_seconds


@dataclass(frozen=True, slots=True)
class CeilingCheck:
    granted: bool
    detail: str = ""
    retry_after_seconds: float | None = None


def check_ceiling(
    *,
    provider: ProviderConfig,
    tokens: int,
    used_tokens: int,
    used_requests: int,
    epoch_seconds: float,
) -> CeilingCheck:
    """May one more call of `tokens` go to this provider, given what the last minute used?"""
    wait = ceiling_room_returns_in(epoch_seconds)
    tpm, rpm = provider.tokens_per_minute, provider.requests_per_minute
    if tpm is not None and tokens > tpm:
        return CeilingCheck(
            False, f"one call of {tokens} tokens exceeds the ceiling of {tpm} tokens/minute"
        )
    if tpm is not None and used_tokens + tokens > tpm:
        return CeilingCheck(
            False,
            f"{used_tokens} of {tpm} tokens/minute used; {tokens} more would pass the ceiling",
            retry_after_seconds=wait,
        )
    if rpm is not None and used_requests + 1 > rpm:
        return CeilingCheck(
            False, f"{used_requests} of {rpm} requests/minute used", retry_after_seconds=wait
        )
    return CeilingCheck(True)
