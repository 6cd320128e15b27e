"""Request validation, chunk rendering and script parsing, as pure functions."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn_fakeprovider.chat_wire import (
    ReplyIds,
    content_pieces,
    parse_chat_request,
    render_chunks,
    render_completion,
)
from cairn_fakeprovider.embeddings import embed_text
from cairn_fakeprovider.errors import RequestRejected, ScriptRejected
from cairn_fakeprovider.reply import PlannedToolCall, Reply
from cairn_fakeprovider.script import (
    AnswerStep,
    CutStreamStep,
    HangStep,
    MalformedStep,
    StatusStep,
    ToolCallStep,
    parse_script,
)

IDS = ReplyIds(
    completion_id="chatcmpl-test", created=1_700_000_000, tool_call_ids=("call_a", "call_b")
)


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant_calls(*ids: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for call_id in ids
        ],
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"messages": [user("hi")]}, "model"),
        (
            {
                "model": "m",
                "messages": [
                    user("hi"),
                    assistant_calls("c1", "c2"),
                    {"role": "tool", "tool_call_id": "c1", "content": "{}"},
                ],
            },
            "messages",
        ),
        (
            {"model": "m", "messages": [user("hi"), assistant_calls("c1"), user("again")]},
            "messages[2].role",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {
                "model": "m",
                "messages": [user("hi")],
                "tools": [{"type": "function", "function": {"name": "bad name"}}],
            },
            "tools[0].function.name",
        ),
        (
            {"model": "m", "messages": [user("hi")], "reasoning_effort": "maximal"},
            "reasoning_effort",
        ),
        ({"model": "m", "messages": [user("hi")], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [user("hi")], "stream": "yes"}, "stream"),
    ],
    ids=[
        "not-an-object",
        "no-model",
        "unanswered-call",
        "conversation-moves-on-before-tool-result",
        "null-user-content",
        "bad-tool-name",
        "unknown-reasoning-effort",
        "zero-max-tokens",
        "stream-not-bool",
    ],
)
def test_request_the_vendor_would_refuse_is_rejected_naming_the_parameter(
    body: object, param: str | None
) -> None:
    with pytest.raises(RequestRejected) as caught:
        parse_chat_request(body)

    assert caught.value.param == param
    assert caught.value.message


def test_full_request_with_parts_tools_and_options_is_accepted() -> None:
    parsed = parse_chat_request(
        {
            "model": "gpt-5-mini",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hello"},
                        {"type": "image_url", "image_url": {"url": "x"}},
                    ],
                },
                assistant_calls("c1"),
                {"role": "tool", "tool_call_id": "c1", "content": '{"results": []}'},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
                }
            ],
            "max_completion_tokens": 256,
            "stream": True,
            "stream_options": {"include_usage": True},
            "reasoning_effort": "low",
            "temperature": 0.2,
        }
    )

    assert parsed.messages[1].content == "hello"
    assert parsed.max_tokens == 256
    assert parsed.include_usage is True
    assert parsed.reasoning_effort == "low"
    assert parsed.offers_tool("f")


def test_completion_renders_parallel_tool_calls_with_the_given_ids() -> None:
    parsed = parse_chat_request({"model": "m", "messages": [user("hi")]})
    reply = Reply(
        content=None, tool_calls=(PlannedToolCall("a", '{"x":1}'), PlannedToolCall("b", "{}"))
    )

    message = render_completion(parsed, reply, ids=IDS)["choices"][0]["message"]

    assert [(call["id"], call["function"]["name"]) for call in message["tool_calls"]] == [
        ("call_a", "a"),
        ("call_b", "b"),
    ]


def test_streamed_parallel_tool_calls_reassemble_per_index() -> None:
    parsed = parse_chat_request({"model": "m", "messages": [user("hi")], "stream": True})
    reply = Reply(
        content=None,
        tool_calls=(PlannedToolCall("a", '{"x": 1, "y": 2}'), PlannedToolCall("b", '{"z": 3}')),
    )

    arguments: dict[int, str] = {}
    names: dict[int, str] = {}
    for chunk in render_chunks(parsed, reply, ids=IDS).all_chunks():
        for call in chunk["choices"][0]["delta"].get("tool_calls", []):
            arguments[call["index"]] = (
                arguments.get(call["index"], "") + call["function"]["arguments"]
            )
            if "name" in call["function"]:
                names[call["index"]] = call["function"]["name"]

    assert names == {0: "a", 1: "b"}
    assert {index: json.loads(text) for index, text in arguments.items()} == {
        0: {"x": 1, "y": 2},
        1: {"z": 3},
    }


@settings(database=None, max_examples=200)
@given(st.text(max_size=500))
def test_content_pieces_join_back_to_the_content_in_a_handful_of_chunks(text: str) -> None:
    pieces = content_pieces(text)

    assert "".join(pieces) == text
    assert len(pieces) <= 8
    assert all(pieces)


def test_every_step_shape_parses_to_its_type() -> None:
    steps = parse_script(
        {
            "steps": [
                {"action": "answer", "content": "hi"},
                {"action": "tool_call", "name": "f", "arguments": {"q": "x"}},
                {"action": "tool_call", "name": "f", "arguments": "{not json"},
                {"action": "status", "status": 429, "retry_after": 2},
                {"action": "hang", "seconds": 30},
                {"action": "cut_stream", "after_chunks": 2},
                {"action": "malformed"},
            ]
        }
    )

    assert steps == [
        AnswerStep(content="hi"),
        ToolCallStep(calls=(PlannedToolCall("f", '{"q":"x"}'),)),
        ToolCallStep(calls=(PlannedToolCall("f", "{not json"),)),
        StatusStep(status=429, retry_after=2),
        HangStep(seconds=30.0),
        CutStreamStep(after_chunks=2),
        MalformedStep(),
    ]


@pytest.mark.parametrize(
    "step",
    [
        {"action": "status", "status": 200},
        {"action": "hang", "seconds": -1},
        {"action": "cut_stream", "after_chunks": "two"},
        {"action": "tool_call"},
        {"action": "answer"},
        {"action": "dance"},
    ],
)
def test_step_outside_the_accepted_shapes_is_rejected(step: dict[str, Any]) -> None:
    with pytest.raises(ScriptRejected, match="must|needs"):
        parse_script({"steps": [step]})


def test_texts_sharing_words_embed_closer_than_unrelated_texts() -> None:
    query = embed_text("annual leave policy")
    related = embed_text("the leave policy for staff")
    unrelated = embed_text("quarterly revenue forecast")

    def cosine(left: list[float], right: list[float]) -> float:
        return sum(a * b for a, b in zip(left, right, strict=True))

    assert cosine(query, related) > cosine(query, unrelated)
