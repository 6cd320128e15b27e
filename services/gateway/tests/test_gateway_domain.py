"""Routing, budgets, ceilings, redaction and span attributes: the pure parts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import (
    CEILING_SEND_ALLOWANCE_SECONDS,
    Attempt,
    ChatMessage,
    ChatRequest,
    Completion,
    Outcome,
    Redactor,
    Route,
    ToolCall,
    UnusableProvider,
    Usage,
    ceiling_bucket,
    ceiling_window_floor,
    check_ceiling,
    check_run_budget,
    estimate_prompt_tokens,
    plan_routes,
    tokens_needed,
)
from cairn_gateway.errors import ChatRequestInvalid, NoUsableProvider, RunBudgetExceeded
from cairn_gateway.instrumentation import request_attributes, result_attributes, span_name
from cairn_libs.token_estimate import estimate_tokens


def provider(name: str, **models: str) -> ProviderConfig:
    return ProviderConfig(
        name=name, base_url=f"https://{name}.example:8443/v1", api_key_env="", models=models
    )  # type: ignore[arg-type]


PROVIDERS = [
    provider("a", fast="a-small", balanced="a-mid"),
    provider("b", balanced="b-mid", deep="b-big"),
    provider("c", fast="shared", deep="shared"),
]


def ask(**fields: object) -> ChatRequest:
    return ChatRequest(messages=(ChatMessage("user", "hello"),), **fields)  # type: ignore[arg-type]


def test_a_tier_routes_to_every_provider_that_serves_it_in_order() -> None:
    assert plan_routes(PROVIDERS, ask(tier="balanced")) == [
        Route("a", "a-mid", "balanced"),
        Route("b", "b-mid", "balanced"),
    ]


def test_no_tier_means_balanced() -> None:
    assert [r.provider for r in plan_routes(PROVIDERS, ask())] == ["a", "b"]


def test_an_explicit_model_wins_and_takes_the_tier_it_is_listed_under() -> None:
    assert plan_routes(PROVIDERS, ask(model="b-big", tier="fast")) == [Route("b", "b-big", "fast")]
    assert plan_routes(PROVIDERS, ask(model="shared")) == [Route("c", "shared", "fast")]


def test_an_unknown_model_is_the_callers_mistake_and_an_unserved_tier_the_deployments() -> None:
    with pytest.raises(ChatRequestInvalid, match="'nope' is not configured"):
        plan_routes(PROVIDERS, ask(model="nope"))
    with pytest.raises(NoUsableProvider, match="no provider for tier 'deep'; tiers served: fast"):
        plan_routes([PROVIDERS[0]], ask(tier="deep"))


KEYLESS = UnusableProvider(
    provider("k", deep="k-big", fast="k-small"), "its key variable K_API_KEY is not set"
)


def test_a_tier_only_an_unusable_provider_serves_names_the_provider_and_why() -> None:
    with pytest.raises(NoUsableProvider) as refused:
        plan_routes([PROVIDERS[0]], ask(tier="deep"), unusable=[KEYLESS])

    assert "no usable provider serves tier 'deep'" in refused.value.message
    assert "'k': its key variable K_API_KEY is not set" in refused.value.message


def test_a_model_only_an_unusable_provider_lists_is_the_deployments_mistake() -> None:
    with pytest.raises(NoUsableProvider, match="model 'k-big' is configured only on provider"):
        plan_routes([PROVIDERS[0]], ask(model="k-big"), unusable=[KEYLESS])


def test_usable_providers_are_routed_to_and_unusable_ones_never() -> None:
    routes = plan_routes([PROVIDERS[0]], ask(tier="fast"), unusable=[KEYLESS])

    assert routes == [Route("a", "a-small", "fast")]


def with_tool_history(**fields: object) -> ChatRequest:
    messages = (
        ChatMessage("user", "hello"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("call-1", "search_knowledge", "{}"),)),
        ChatMessage("tool", '{"results": []}', tool_call_id="call-1"),
    )
    return ChatRequest(messages=messages, **fields)  # type: ignore[arg-type]


def test_a_conversation_with_tool_calls_goes_only_to_the_provider_that_made_them() -> None:
    routes = plan_routes(PROVIDERS, with_tool_history(tier="balanced", pinned_provider="b"))
    assert routes == [Route("b", "b-mid", "balanced")]


def test_a_pin_without_tool_history_leaves_failover_free() -> None:
    routes = plan_routes(PROVIDERS, ask(tier="balanced", pinned_provider="b"))
    assert [r.provider for r in routes] == ["a", "b"]


def test_a_pin_to_a_provider_that_cannot_serve_the_request_is_refused() -> None:
    with pytest.raises(ChatRequestInvalid, match="pinned_provider 'c' made the tool calls"):
        plan_routes(PROVIDERS, with_tool_history(tier="balanced", pinned_provider="c"))


def test_prompt_tokens_are_estimated_at_four_characters_each_including_tool_calls() -> None:
    messages = [
        ChatMessage("user", "x" * 10),
        ChatMessage("assistant", "", tool_calls=(ToolCall("id", "abcd", "y" * 6),)),
    ]

    assert estimate_prompt_tokens(messages) == 5  # ceil(20 / 4)


@given(st.lists(st.text(max_size=40), max_size=6), st.text(max_size=20))
@settings(max_examples=60)
def test_the_prompt_estimate_is_the_shared_estimate_of_everything_the_provider_reads(
    contents: list[str], arguments: str
) -> None:
    messages = [ChatMessage("user", c) for c in contents]
    messages.append(ChatMessage("assistant", "", tool_calls=(ToolCall("id", "f", arguments),)))
    read = "".join(contents) + "f" + arguments

    assert estimate_prompt_tokens(messages) == estimate_tokens(read)


def test_a_call_that_fits_the_budget_passes_and_one_that_does_not_is_refused() -> None:
    fits = ask(max_tokens=100, remaining_budget_tokens=102, run_id="r1")
    too_big = ask(remaining_budget_tokens=1000, run_id="r1")  # 2 + default 1024

    assert check_run_budget(fits) == tokens_needed(fits) == 102
    with pytest.raises(RunBudgetExceeded, match="run 'r1' has 1000 tokens left"):
        check_run_budget(too_big)
    with pytest.raises(RunBudgetExceeded, match="50 are reserved"):
        check_run_budget(fits, reserved_in_flight=50)


def test_no_budget_means_no_refusal() -> None:
    assert check_run_budget(ask(max_tokens=10**6)) == 10**6 + 2


@given(
    used=st.integers(0, 20_000),
    tokens=st.integers(1, 20_000),
    moment=st.floats(0, 1e9, allow_nan=False),
)
def test_a_ceiling_is_never_granted_past_its_tokens_per_minute(
    used: int, tokens: int, moment: float
) -> None:
    limited = ProviderConfig(
        name="g",
        base_url="https://g/v1",
        api_key_env="",
        models={"fast": "m"},
        tokens_per_minute=8000,
    )

    check = check_ceiling(
        provider=limited, tokens=tokens, used_tokens=used, used_requests=0, epoch_seconds=moment
    )

    assert check.granted is (used + tokens <= 8000)
    if not check.granted and tokens <= 8000:
        assert check.retry_after_seconds is not None and 0 < check.retry_after_seconds <= 10


def test_the_counted_window_covers_the_last_minute_and_the_send_allowance() -> None:
    for moment in (0.0, 4.99, 5.0, 9.99, 10.0, 59.5, 123.4, 125.0):
        floor = ceiling_window_floor(moment)
        assert moment - 75 < floor <= moment - 60 - CEILING_SEND_ALLOWANCE_SECONDS
        assert ceiling_bucket(moment) <= moment < ceiling_bucket(moment) + 10


EIGHT_THOUSAND = ProviderConfig(
    name="g", base_url="https://g/v1", api_key_env="", models={"fast": "m"}, tokens_per_minute=8000
)


def sent_under_the_ceiling(
    calls: list[tuple[float, int, float]],
    start: float,
    *,
    window_floor: Callable[[float], int] = ceiling_window_floor,
) -> list[tuple[float, int]]:
    """What reaches the vendor when every call is checked as the PostgreSQL ledger
    checks it: (gap since the previous call, tokens, delay from grant to vendor)."""
    buckets: dict[int, int] = {}
    sent = []
    moment = start
    for gap, tokens, delay in calls:
        moment += gap
        floor = window_floor(moment)
        check = check_ceiling(
            provider=EIGHT_THOUSAND,
            tokens=tokens,
            used_tokens=sum(used for bucket, used in buckets.items() if bucket >= floor),
            used_requests=0,
            epoch_seconds=moment,
        )
        if check.granted:
            buckets[ceiling_bucket(moment)] = buckets.get(ceiling_bucket(moment), 0) + tokens
            sent.append((moment + delay, tokens))
    return sent


@settings(max_examples=400, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.floats(0, 40, allow_nan=False),
            st.integers(1, 4000),
            st.floats(0, CEILING_SEND_ALLOWANCE_SECONDS, allow_nan=False),
        ),
        min_size=1,
        max_size=40,
    ),
    start=st.floats(0, 1e6, allow_nan=False),
)
def test_a_ceiling_of_8000_is_never_passed_in_any_sliding_minute_at_the_vendor(
    calls: list[tuple[float, int, float]], start: float
) -> None:
    sent = sent_under_the_ceiling(calls, start)

    for arrived, _ in sent:
        in_minute = sum(tokens for other, tokens in sent if arrived - 60 < other <= arrived)
        assert in_minute <= 8000


def test_without_the_send_allowance_two_full_minutes_would_reach_the_vendor_together() -> None:
    # A full ceiling granted just before a bucket boundary and sent a moment later,
    # then another full one 60.01 s after the grant: the vendor sees both within a minute.
    calls = [(9.99, 8000, 0.02), (60.01, 8000, 0.0)]

    def exactly_one_minute(moment: float) -> int:
        return ceiling_bucket(moment) - 60

    assert [t for _, t in sent_under_the_ceiling(calls, 0.0, window_floor=exactly_one_minute)] == [
        8000,
        8000,
    ]
    assert [t for _, t in sent_under_the_ceiling(calls, 0.0)] == [8000]


def test_requests_per_minute_is_a_ceiling_too() -> None:
    limited = ProviderConfig(
        name="g",
        base_url="https://g/v1",
        api_key_env="",
        models={"fast": "m"},
        requests_per_minute=3,
    )

    assert check_ceiling(
        provider=limited, tokens=5, used_tokens=0, used_requests=2, epoch_seconds=1
    ).granted
    assert not check_ceiling(
        provider=limited, tokens=5, used_tokens=0, used_requests=3, epoch_seconds=1
    ).granted


def test_a_call_larger_than_the_whole_ceiling_has_no_retry_time() -> None:
    limited = ProviderConfig(
        name="g",
        base_url="https://g/v1",
        api_key_env="",
        models={"fast": "m"},
        tokens_per_minute=100,
    )

    check = check_ceiling(
        provider=limited, tokens=101, used_tokens=0, used_requests=0, epoch_seconds=1
    )

    assert not check.granted and check.retry_after_seconds is None


def test_the_redactor_removes_the_key_and_echoed_prompt_text() -> None:
    prompt = "Please summarise the salary review for Jane Doe in finance"
    redact = Redactor(secrets=("sk-live-abc123",)).with_prompt([ChatMessage("user", prompt)])

    text = redact(f"Invalid key sk-live-abc123; could not process '{prompt[:40]}...'")

    assert "sk-live-abc123" not in text and "Jane" not in text and "salary" not in text
    assert "[redacted]" in text and "[prompt]" in text


@given(
    prompt=st.text(min_size=12, max_size=200),
    start=st.integers(0, 200),
    length=st.integers(12, 120),
    before=st.text(max_size=40),
    after=st.text(max_size=40),
)
def test_no_echoed_fragment_of_the_prompt_survives_the_redactor(
    prompt: str, start: int, length: int, before: str, after: str
) -> None:
    start = min(start, len(prompt) - 12)
    echoed = prompt[start : start + length]
    redact = Redactor(max_chars=10_000).with_prompt([ChatMessage("user", prompt)])

    text = redact(f"{before}{echoed}{after}")

    assert not [prompt[i : i + 12] for i in range(len(prompt) - 11) if prompt[i : i + 12] in text]


def test_the_redactor_leaves_an_error_that_quotes_nothing_alone() -> None:
    redact = Redactor().with_prompt([ChatMessage("user", "What is the capital of France?")])

    assert redact("Rate limit reached for requests.") == "Rate limit reached for requests."


def test_the_redactor_leaves_no_u0000_in_a_vendors_words() -> None:
    # A vendor's error text becomes an error message a run then stores in PostgreSQL.
    assert Redactor()("bad\x00request\x00") == "bad\ufffdrequest\ufffd"


def test_the_redactor_cuts_long_text() -> None:
    assert len(Redactor()("x" * 5000)) == 300


SECRET_PROMPT = "The launch code is 0000 and the patient is Mr Smith"


def attributes(trace_content: bool) -> dict[str, object]:
    request = ChatRequest(
        messages=(ChatMessage("user", SECRET_PROMPT),), run_id="run-1", max_tokens=64
    )
    route = Route("a", "a-mid", "balanced")
    completion = Completion(
        ChatMessage("assistant", "Noted, Mr Smith."), "stop", Usage(12, 5, 17), "a-mid-2025"
    )
    attempt = Attempt("a", "a-mid", Outcome.OK, 200, 0.1)
    return {
        **request_attributes(
            route, PROVIDERS[0], request, reasoning_effort="medium", trace_content=trace_content
        ),
        **result_attributes(attempt, completion, trace_content=trace_content),
    }


def test_spans_carry_the_genai_attributes_and_no_content_by_default() -> None:
    recorded = attributes(trace_content=False)

    assert span_name(Route("a", "a-mid", "balanced")) == "chat a-mid"
    assert recorded["gen_ai.operation.name"] == "chat"
    assert recorded["gen_ai.provider.name"] == "a"
    assert recorded["gen_ai.request.model"] == "a-mid"
    assert recorded["gen_ai.response.model"] == "a-mid-2025"
    assert (recorded["gen_ai.usage.input_tokens"], recorded["gen_ai.usage.output_tokens"]) == (
        12,
        5,
    )
    assert recorded["gen_ai.response.finish_reasons"] == ["stop"]
    assert (recorded["server.address"], recorded["server.port"]) == ("a.example", 8443)
    assert "Smith" not in repr(recorded)


def test_content_is_recorded_only_when_the_deployment_turns_it_on() -> None:
    recorded = attributes(trace_content=True)

    assert SECRET_PROMPT in str(recorded["gen_ai.input.messages"])
    assert "Noted, Mr Smith." in str(recorded["gen_ai.output.messages"])
