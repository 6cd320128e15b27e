"""The fake provider over real HTTP: answers, tool calls, streams, embeddings, control."""

from __future__ import annotations

import base64
import json
import math
import struct
import time
from typing import Any

import httpx
import pytest

CHAT = "/v1/chat/completions"
LEAVE_KNOWLEDGE = (
    "<<<CAIRN-DATA kind=knowledge nonce=9f3a>>>\n"
    "[S1] Leave policy (source: handbook)\n"
    "Staff get 25 days of paid leave a year. Up to 5 days carry over. Ask HR for more.\n"
    "[S2] Expenses (source: handbook)\n"
    "Expenses are paid monthly.\n"
    "<<<END-CAIRN-DATA nonce=9f3a>>>\n"
    "How much leave do I get?"
)
LEAVE_ANSWER = (
    "[offline demo model] Staff get 25 days of paid leave a year. Up to 5 days carry over. [S1]"
)
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_knowledge",
        "description": "Search the knowledge the caller may read.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Answer from the data only."},
            {"role": "user", "content": content},
        ],
        **extra,
    }


def sse_payloads(response: httpx.Response) -> list[str]:
    return [
        line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")
    ]


def test_plain_question_is_answered_from_fenced_knowledge_with_a_citation(
    client: httpx.Client,
) -> None:
    body = chat_body(LEAVE_KNOWLEDGE)
    response = client.post(CHAT, json=body)

    assert response.status_code == 200
    completion = response.json()
    assert completion["object"] == "chat.completion"
    assert completion["id"].startswith("chatcmpl-")
    assert completion["model"] == "gpt-4o-mini"
    choice = completion["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": LEAVE_ANSWER, "refusal": None}
    assert choice["finish_reason"] == "stop"
    prompt_chars = sum(len(message["content"]) for message in body["messages"])
    usage = completion["usage"]
    assert usage["prompt_tokens"] == math.ceil(prompt_chars / 4)
    assert usage["completion_tokens"] == math.ceil(len(LEAVE_ANSWER) / 4)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_offered_search_tool_is_called_with_the_question(client: httpx.Client) -> None:
    response = client.post(CHAT, json=chat_body("What is the leave policy?", tools=[SEARCH_TOOL]))

    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_")
    assert call["type"] == "function"
    assert call["function"]["name"] == "search_knowledge"
    assert json.loads(call["function"]["arguments"]) == {"query": "What is the leave policy?"}


def test_search_result_in_a_tool_message_becomes_a_cited_answer(client: httpx.Client) -> None:
    first = client.post(CHAT, json=chat_body("How long is parental leave?", tools=[SEARCH_TOOL]))
    assistant = first.json()["choices"][0]["message"]
    result = {
        "results": [
            {
                "label": "S1",
                "title": "Parental leave",
                "text": "Parents get 16 weeks of paid leave. It can be split.",
                "score": 0.91,
            }
        ],
        "mode": "hybrid",
    }
    body = chat_body("How long is parental leave?", tools=[SEARCH_TOOL])
    body["messages"] += [
        assistant,
        {
            "role": "tool",
            "tool_call_id": assistant["tool_calls"][0]["id"],
            "content": json.dumps(result),
        },
    ]

    second = client.post(CHAT, json=body).json()["choices"][0]

    assert second["finish_reason"] == "stop"
    assert "tool_calls" not in second["message"]
    assert second["message"]["content"] == (
        "[offline demo model] Parents get 16 weeks of paid leave. It can be split. [S1]"
    )


def test_streamed_answer_assembles_to_the_non_streamed_answer_and_ends_with_done(
    client: httpx.Client,
) -> None:
    with client.stream("POST", CHAT, json=chat_body(LEAVE_KNOWLEDGE, stream=True)) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    pieces = [chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks]
    assert len([piece for piece in pieces if piece]) >= 3
    assert "".join(pieces) == LEAVE_ANSWER
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])


def test_stream_usage_chunk_arrives_only_when_include_usage_is_set(client: httpx.Client) -> None:
    with_usage = chat_body(LEAVE_KNOWLEDGE, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", CHAT, json=with_usage) as response:
        counted = [json.loads(payload) for payload in sse_payloads(response)[:-1]]
    with client.stream("POST", CHAT, json=chat_body(LEAVE_KNOWLEDGE, stream=True)) as response:
        uncounted = [json.loads(payload) for payload in sse_payloads(response)[:-1]]

    usage_chunk = counted[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == math.ceil(len(LEAVE_ANSWER) / 4)
    assert all(chunk["usage"] is None for chunk in counted[:-1])
    assert all("usage" not in chunk for chunk in uncounted)


def test_streamed_tool_call_uses_the_openai_delta_format(client: httpx.Client) -> None:
    body = chat_body("Where is the fire exit?", tools=[SEARCH_TOOL], stream=True)
    with client.stream("POST", CHAT, json=body) as response:
        payloads = sse_payloads(response)

    assert payloads[-1] == "[DONE]"
    deltas = [json.loads(payload)["choices"][0] for payload in payloads[:-1]]
    calls = [call for choice in deltas for call in choice["delta"].get("tool_calls", [])]
    assert calls[0]["index"] == 0
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "search_knowledge"
    assert len(calls) > 2, "arguments should arrive in several pieces"
    arguments = "".join(call["function"]["arguments"] for call in calls)
    assert json.loads(arguments) == {"query": "Where is the fire exit?"}
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_models_lists_the_offline_demo_model(client: httpx.Client) -> None:
    listing = client.get("/v1/models").json()

    assert listing["object"] == "list"
    assert [model["id"] for model in listing["data"]] == ["cairn-offline-demo"]


def test_embeddings_are_deterministic_unit_length_and_384_wide(client: httpx.Client) -> None:
    body = {"model": "text-embedding-3-small", "input": ["leave policy", "fire exit"]}
    first = client.post("/v1/embeddings", json=body).json()
    second = client.post("/v1/embeddings", json=body).json()

    assert first["data"] == second["data"]
    leave, exit_ = (item["embedding"] for item in first["data"])
    assert len(leave) == len(exit_) == 384
    assert math.isclose(sum(value * value for value in leave), 1.0, rel_tol=1e-9)
    assert leave != exit_
    assert [item["index"] for item in first["data"]] == [0, 1]
    assert first["model"] == "text-embedding-3-small"
    assert first["usage"]["prompt_tokens"] == first["usage"]["total_tokens"] > 0


def test_base64_embeddings_decode_to_the_float_vectors(client: httpx.Client) -> None:
    body = {"model": "text-embedding-3-small", "input": "leave policy"}
    floats = client.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    encoded = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()

    raw = base64.b64decode(encoded["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert decoded == pytest.approx(floats, abs=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (
            json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
            "messages[0].role",
        ),
        (
            json.dumps(
                {
                    "model": "m",
                    "messages": [{"role": "tool", "tool_call_id": "call_x", "content": "{}"}],
                }
            ).encode(),
            "messages[0].tool_call_id",
        ),
        (
            json.dumps(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream_options": {"include_usage": True},
                }
            ).encode(),
            "stream_options",
        ),
    ],
    ids=[
        "not-json",
        "no-messages",
        "unknown-role",
        "orphan-tool-message",
        "stream-options-without-stream",
    ],
)
def test_malformed_request_is_refused_with_an_openai_400(
    client: httpx.Client, body: bytes, param: str | None
) -> None:
    response = client.post(CHAT, content=body, headers={"content-type": "application/json"})

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["code"]
    assert error["param"] == param


def test_rejected_request_does_not_spend_a_scripted_step(client: httpx.Client) -> None:
    client.post("/_control/script", json={"steps": [{"action": "answer", "content": "scripted"}]})

    refused = client.post(CHAT, json={"model": "m", "messages": []})
    answered = client.post(CHAT, json=chat_body("hello"))

    assert refused.status_code == 400
    assert answered.json()["choices"][0]["message"]["content"] == "scripted"


def test_scripted_steps_are_served_first_in_first_out_then_default_resumes(
    client: httpx.Client,
) -> None:
    queued = client.post(
        "/_control/script",
        json={
            "steps": [
                {"action": "answer", "content": "first"},
                {"action": "tool_call", "name": "lookup_person", "arguments": {"name": "Ada"}},
                {"action": "answer", "content": "third"},
            ]
        },
    ).json()
    assert queued == {"queued": 3, "actions": ["answer", "tool_call", "answer"]}

    messages = [client.post(CHAT, json=chat_body("hello")).json()["choices"][0] for _ in range(4)]

    assert messages[0]["message"]["content"] == "first"
    call = messages[1]["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("lookup_person", {"name": "Ada"})
    assert messages[1]["finish_reason"] == "tool_calls"
    assert messages[2]["message"]["content"] == "third"
    assert messages[3]["message"]["content"].startswith("[offline demo model] ")
    assert client.get("/_control/script").json()["queued"] == 0


def test_bad_script_step_is_refused_and_nothing_is_queued(client: httpx.Client) -> None:
    response = client.post(
        "/_control/script",
        json={"steps": [{"action": "answer", "content": "ok"}, {"action": "explode"}]},
    )

    assert response.status_code == 400
    assert "explode" in response.json()["error"]["message"]
    assert client.get("/_control/script").json()["queued"] == 0


def test_request_log_records_path_body_and_only_whether_authorization_was_sent(
    client: httpx.Client,
) -> None:
    before = time.time()
    body = chat_body("hello")
    client.post(CHAT, json=body, headers={"Authorization": "Bearer sk-very-secret"})
    client.post("/v1/embeddings", json={"model": "e", "input": "hello"})

    log = client.get("/_control/requests")
    entries = log.json()["requests"]

    assert "sk-very-secret" not in log.text
    assert [entry["path"] for entry in entries] == [CHAT, "/v1/embeddings"]
    chat_entry, embeddings_entry = entries
    assert chat_entry["body"] == body
    assert chat_entry["authorization_present"] is True
    assert chat_entry["headers"]["authorization"] == "[redacted]"
    assert chat_entry["handled_as"] == "default"
    assert before <= chat_entry["received_at"] <= time.time()
    assert embeddings_entry["authorization_present"] is False
    assert "authorization" not in embeddings_entry["headers"]


def test_reset_empties_the_script_queue_and_the_request_log(client: httpx.Client) -> None:
    client.post(CHAT, json=chat_body("hello"))
    client.post("/_control/script", json={"steps": [{"action": "malformed"}]})

    client.post("/_control/reset")

    assert client.get("/_control/requests").json() == {"requests": []}
    assert client.get("/_control/script").json() == {"queued": 0, "actions": []}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_answer_longer_than_max_tokens_stops_there_with_finish_reason_length(
    client: httpx.Client, stream: bool
) -> None:
    question = "Tell me everything about " + "the leave policy " * 40
    extra: dict[str, Any] = {"max_tokens": 10}
    if stream:
        extra |= {"stream": True, "stream_options": {"include_usage": True}}
    full = client.post(CHAT, json=chat_body(question)).json()["choices"][0]["message"]["content"]

    if stream:
        with client.stream("POST", CHAT, json=chat_body(question, **extra)) as response:
            chunks = [json.loads(p) for p in sse_payloads(response)[:-1]]
        content = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        usage = chunks[-1]["usage"]
    else:
        body = client.post(CHAT, json=chat_body(question, **extra)).json()
        content = body["choices"][0]["message"]["content"]
        finish, usage = body["choices"][0]["finish_reason"], body["usage"]

    assert len(full) > 40
    assert content == full[:40]
    assert finish == "length"
    assert usage["completion_tokens"] == 10


def test_a_scripted_answer_that_fits_max_tokens_is_sent_whole(client: httpx.Client) -> None:
    client.post("/_control/script", json={"steps": [{"action": "answer", "content": "Paris."}]})

    body = client.post(CHAT, json=chat_body("Capital of France?", max_tokens=2)).json()

    assert body["choices"][0]["message"]["content"] == "Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
