"""The chat-completions wire format both ways, with the quirks vendors really have."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from cairn_gateway.domain import (
    Attempt,
    ChatMessage,
    ChatRequest,
    ChatResult,
    Outcome,
    Route,
    ToolCall,
    ToolDefinition,
    Usage,
)
from cairn_gateway.servicer import chat_response_to_proto
from cairn_gateway.wire import (
    MalformedResponse,
    SseDecoder,
    StreamAssembler,
    chat_body,
    error_text_from_body,
    loads_vendor_json,
    parse_completion,
    parse_embeddings,
    parse_retry_after,
)

ROUTE = Route(provider="p", model="m-1", tier="deep")


def test_the_request_body_carries_messages_tools_and_limits_exactly() -> None:
    request = ChatRequest(
        messages=(
            ChatMessage("system", "Be brief."),
            ChatMessage("user", "Prices?", name="ada"),
            ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "search", '{"q": "p"}'),)),
            ChatMessage("tool", '{"hits": 1}', tool_call_id="c1"),
        ),
        tools=(ToolDefinition("search", "Search.", {"type": "object"}),),
        max_tokens=50,
        temperature=0.2,
    )

    body = chat_body(
        request,
        ROUTE,
        stream=True,
        reasoning_effort="high",
        max_tokens_field="max_completion_tokens",
    )

    assert body == {
        "model": "m-1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Prices?", "name": "ada"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"q": "p"}'},
                    }
                ],
            },
            {"role": "tool", "content": '{"hits": 1}', "tool_call_id": "c1"},
        ],
        "max_completion_tokens": 50,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "search",
                    "description": "Search.",
                    "parameters": {"type": "object"},
                },
            }
        ],
        "temperature": 0.2,
        "reasoning_effort": "high",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_a_body_without_effort_tools_or_stream_leaves_them_out() -> None:
    body = chat_body(
        ChatRequest(messages=(ChatMessage("user", "hi"),)),
        ROUTE,
        stream=False,
        reasoning_effort=None,
        max_tokens_field="max_tokens",
    )

    assert set(body) == {"model", "messages", "max_tokens"}
    assert body["max_tokens"] == 1024


def completion(message: dict[str, object], **extra: object) -> dict[str, object]:
    return {
        "model": "m-1-2025",
        "choices": [{"index": 0, "message": message, "finish_reason": extra.pop("finish", "stop")}],
        **extra,
    }


def test_a_completion_is_parsed_with_usage_and_the_reported_model() -> None:
    parsed = parse_completion(
        completion(
            {"role": "assistant", "content": "Hi."},
            usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        ),
        requested_model="m-1",
    )

    assert parsed.message == ChatMessage("assistant", "Hi.")
    assert parsed.usage == Usage(5, 2, 7) and not parsed.usage_estimated
    assert parsed.model == "m-1-2025"


def test_tool_call_arguments_keep_their_exact_text() -> None:
    arguments = '{ "q" : "été",  "k":3 }'
    parsed = parse_completion(
        completion(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "search", "arguments": arguments},
                    }
                ],
            },
            finish="tool_calls",
        ),
        requested_model="m-1",
    )

    assert parsed.message.tool_calls == (ToolCall("call_9", "search", arguments),)
    assert parsed.finish_reason == "tool_calls"


def test_missing_usage_is_estimated_and_said_so() -> None:
    parsed = parse_completion(
        completion({"role": "assistant", "content": "x" * 40}), requested_model="m"
    )

    assert parsed.usage_estimated and parsed.usage.completion_tokens == 10


def test_a_tool_call_without_an_id_gets_one() -> None:
    parsed = parse_completion(
        completion(
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}],
            }
        ),
        requested_model="m",
    )

    (call,) = parsed.message.tool_calls
    assert call.id.startswith("call_") and call.arguments_json == '{"a":1}'


@pytest.mark.parametrize(
    "payload",
    [
        [],
        {"choices": []},
        {"choices": [{"index": 0}]},
        {"choices": [{"message": {"role": "assistant", "content": 7}}]},
        {"choices": [{"message": {"role": "assistant", "content": None}, "finish_reason": "stop"}]},
        {"choices": [{"message": {"role": "assistant", "tool_calls": [{"function": {}}]}}]},
        {"error": {"message": "overloaded"}},
    ],
)
def test_a_malformed_completion_is_refused(payload: object) -> None:
    with pytest.raises(MalformedResponse):
        parse_completion(payload, requested_model="m")


def test_sse_events_are_decoded_across_comments_and_multi_line_data() -> None:
    decoder = SseDecoder()
    lines = [
        ": OPENROUTER PROCESSING",
        "",
        'data: {"a":',
        "data: 1}",
        "",
        "event: x",
        "data: [DONE]",
        "",
    ]

    events = [e for e in (decoder.feed(line) for line in lines) if e is not None]

    assert events == ['{"a":\n1}', "[DONE]"]


def chunk(
    delta: dict[str, object], finish: str | None = None, **extra: object
) -> dict[str, object]:
    return {
        "model": "m-1",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }


def test_streamed_content_and_tool_call_fragments_reassemble() -> None:
    assembler = StreamAssembler(requested_model="m-1")
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Let me "}),
        chunk({"content": "look."}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "search", "arguments": ""},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"q": '}}]}),
        chunk(
            {
                "tool_calls": [
                    {"index": 1, "id": "c2", "function": {"name": "fetch", "arguments": "{}"}}
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}),
        chunk({}, finish="tool_calls"),
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}},
    ]

    deltas = [assembler.feed(c) for c in chunks]

    assert "".join(deltas) == "Let me look." and deltas[1] == "Let me "
    result = assembler.completion()
    assert result.message.content == "Let me look."
    assert result.message.tool_calls == (
        ToolCall("c1", "search", '{"q": "x"}'),
        ToolCall("c2", "fetch", "{}"),
    )
    assert (result.finish_reason, result.usage) == ("tool_calls", Usage(9, 4, 13))


def test_tool_calls_streamed_without_an_index_are_told_apart_by_id() -> None:
    assembler = StreamAssembler(requested_model="m")
    assembler.feed(
        chunk({"tool_calls": [{"id": "a", "function": {"name": "f", "arguments": '{"x":1}'}}]})
    )
    assembler.feed(
        chunk(
            {"tool_calls": [{"id": "b", "function": {"name": "g", "arguments": "{}"}}]},
            "tool_calls",
        )
    )

    calls = assembler.completion().message.tool_calls

    assert [(c.id, c.name, c.arguments_json) for c in calls] == [
        ("a", "f", '{"x":1}'),
        ("b", "g", "{}"),
    ]


def test_a_stream_without_usage_is_estimated() -> None:
    assembler = StreamAssembler(requested_model="m")
    assembler.feed(chunk({"content": "abcdefgh"}, "stop"))

    result = assembler.completion(prompt_tokens_estimate=30)

    assert result.usage_estimated and result.usage == Usage(30, 2, 32)


@pytest.mark.parametrize(
    "bad",
    [
        "text",
        {"choices": "x"},
        {"choices": [{"delta": {"content": 5}}]},
        {"choices": [{"delta": {"tool_calls": ["x"]}}]},
    ],
)
def test_a_malformed_chunk_is_refused(bad: object) -> None:
    with pytest.raises(MalformedResponse):
        StreamAssembler(requested_model="m").feed(bad)


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"Retry-After": "7"}, 7.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "250", "Retry-After": "9"}, 0.25),
        ({"Retry-After": "Wed, 21 Oct 2026 07:28:30 GMT"}, 30.0),
        ({"Retry-After": "soon"}, None),
        ({}, None),
    ],
)
def test_retry_after_is_read_as_seconds_milliseconds_or_a_date(
    headers: dict[str, str], seconds: float | None
) -> None:
    now = datetime(2026, 10, 21, 7, 28, 0, tzinfo=UTC)

    assert parse_retry_after(headers, now=now) == seconds


def test_a_vendors_error_body_is_read_for_its_message_and_labels() -> None:
    body = json.dumps(
        {"error": {"message": "Bad 'tools'.", "type": "invalid_request_error", "param": "tools"}}
    )

    assert error_text_from_body(body.encode()) == "Bad 'tools'. [invalid_request_error, tools]"
    assert (
        error_text_from_body(b'[{"error": {"code": 400, "message": "Gemini says no"}}]')
        == "Gemini says no [400]"
    )
    assert error_text_from_body(b"<html>502 Bad Gateway</html>") == "<html>502 Bad Gateway</html>"


def test_embeddings_come_back_in_input_order() -> None:
    payload = {
        "data": [{"index": 1, "embedding": [0.0, 1.0]}, {"index": 0, "embedding": [1.0, 0.0]}]
    }

    assert parse_embeddings(payload, count=2) == [[1.0, 0.0], [0.0, 1.0]]
    with pytest.raises(MalformedResponse):
        parse_embeddings(payload, count=3)


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 2**70, "completion_tokens": 2},
        {"prompt_tokens": -5, "completion_tokens": 2},
        {"prompt_tokens": True, "completion_tokens": 2},
    ],
    ids=["beyond int64", "negative", "a boolean"],
)
def test_usage_a_vendor_could_not_have_counted_is_estimated_and_still_reaches_the_caller(
    usage: dict[str, object],
) -> None:
    parsed = parse_completion(
        completion({"role": "assistant", "content": "x" * 40}, usage=usage), requested_model="m"
    )

    assert parsed.usage_estimated and parsed.usage.completion_tokens == 10
    result = ChatResult(parsed, "p", (Attempt("p", "m", Outcome.OK),))
    assert chat_response_to_proto(result).usage.completion_tokens == 10


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300])
def test_an_embedding_holding_a_value_no_index_can_store_is_malformed(bad: float) -> None:
    with pytest.raises(MalformedResponse, match=r"data\[0\].embedding"):
        parse_embeddings({"data": [{"embedding": [0.5, bad]}]}, count=1)


def test_a_total_past_any_real_call_is_replaced_by_the_sum_of_its_parts() -> None:
    parsed = parse_completion(
        completion(
            {"role": "assistant", "content": "Hi."},
            usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 2**64},
        ),
        requested_model="m",
    )

    assert parsed.usage == Usage(5, 2, 7)
    result = ChatResult(parsed, "p", (Attempt("p", "m", Outcome.OK),))
    assert chat_response_to_proto(result).usage.total_tokens == 7


def test_a_streamed_chunk_with_a_lone_surrogate_is_read_as_a_replacement_character() -> None:
    assembler = StreamAssembler(requested_model="m")
    chunk = '{"choices": [{"delta": {"content": "a\\ud800b"}, "finish_reason": "stop"}]}'

    assert assembler.feed(loads_vendor_json(chunk)) == "a\ufffdb"
    # A well-formed pair (an emoji) is one character and left alone.
    assert loads_vendor_json(b'"\\ud83d\\ude00"') == "\U0001f600"
