"""Scripted faults arrive on the wire the way a misbehaving vendor would send them."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

CHAT = "/v1/chat/completions"
QUESTION = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "How are you today?"}]}
STREAMED_QUESTION = {**QUESTION, "stream": True}


def script(client: httpx.Client, *steps: dict[str, Any]) -> None:
    client.post("/_control/script", json={"steps": list(steps)}).raise_for_status()


def test_scripted_429_carries_retry_after(client: httpx.Client) -> None:
    script(client, {"action": "status", "status": 429, "retry_after": 2, "retry_after_ms": 1500})

    response = client.post(CHAT, json=QUESTION)

    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert response.headers["retry-after-ms"] == "1500"
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["message"]


def test_a_status_can_be_delayed_like_a_vendor_that_queues_before_refusing(
    client: httpx.Client,
) -> None:
    script(client, {"action": "status", "status": 503, "after_seconds": 0.3})

    started = time.monotonic()
    response = client.post(CHAT, json=QUESTION)

    assert response.status_code == 503
    assert time.monotonic() - started >= 0.3


def test_status_without_retry_after_sends_no_retry_header(client: httpx.Client) -> None:
    script(client, {"action": "status", "status": 429, "code": "insufficient_quota"})

    response = client.post(CHAT, json=QUESTION)

    assert response.status_code == 429
    assert "retry-after" not in response.headers
    assert response.json()["error"]["code"] == "insufficient_quota"


@pytest.mark.parametrize(
    ("status", "error_type", "code"),
    [
        (500, "server_error", "server_error"),
        (503, "server_error", "service_unavailable"),
        (400, "invalid_request_error", "invalid_request"),
        (401, "invalid_request_error", "invalid_api_key"),
    ],
)
def test_scripted_status_uses_the_openai_error_shape(
    client: httpx.Client, status: int, error_type: str, code: str
) -> None:
    script(client, {"action": "status", "status": status})

    response = client.post(CHAT, json=QUESTION)

    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (error_type, code)
    assert isinstance(error["message"], str) and error["message"]


def test_scripted_status_on_a_stream_is_a_json_error_not_an_event_stream(
    client: httpx.Client,
) -> None:
    script(client, {"action": "status", "status": 503})

    response = client.post(CHAT, json=STREAMED_QUESTION)

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"


def test_scripted_hang_outlasts_a_short_client_timeout(client: httpx.Client) -> None:
    script(client, {"action": "hang", "seconds": 30})

    with pytest.raises(httpx.ReadTimeout):
        client.post(CHAT, json=QUESTION, timeout=0.5)
    started = time.monotonic()
    after = client.post(CHAT, json=QUESTION)

    assert after.status_code == 200
    assert after.json()["choices"][0]["message"]["content"].startswith("[offline demo model] ")
    assert time.monotonic() - started < 5, "the hang must not hold up the next request"


def test_short_hang_still_answers_after_the_delay(client: httpx.Client) -> None:
    script(client, {"action": "hang", "seconds": 0.3})

    started = time.monotonic()
    response = client.post(CHAT, json=QUESTION)

    assert time.monotonic() - started >= 0.3
    assert response.json()["choices"][0]["finish_reason"] == "stop"


def test_cut_stream_drops_the_connection_after_n_content_chunks_without_done(
    client: httpx.Client,
) -> None:
    script(client, {"action": "cut_stream", "after_chunks": 2})
    received: list[str] = []

    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", CHAT, json=STREAMED_QUESTION) as response,
    ):
        assert response.status_code == 200
        received.extend(
            line.removeprefix("data: ")
            for line in response.iter_lines()
            if line.startswith("data: ")
        )

    assert "[DONE]" not in received
    deltas = [json.loads(payload)["choices"][0]["delta"] for payload in received]
    assert deltas[0]["role"] == "assistant"
    assert len([delta for delta in deltas if delta.get("content")]) == 2


def test_cut_non_streaming_response_closes_mid_body(client: httpx.Client) -> None:
    script(client, {"action": "cut_stream", "after_chunks": 1})

    with pytest.raises(httpx.RemoteProtocolError):
        client.post(CHAT, json=QUESTION)
    assert client.post(CHAT, json=QUESTION).status_code == 200


def test_scripted_malformed_body_is_not_json(client: httpx.Client) -> None:
    script(client, {"action": "malformed"})

    response = client.post(CHAT, json=QUESTION)

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    with pytest.raises(json.JSONDecodeError):
        response.json()


def test_scripted_malformed_stream_sends_a_data_line_that_is_not_json(
    client: httpx.Client,
) -> None:
    script(client, {"action": "malformed"})

    with client.stream("POST", CHAT, json=STREAMED_QUESTION) as response:
        payloads = [
            line.removeprefix("data: ")
            for line in response.iter_lines()
            if line.startswith("data: ")
        ]

    assert response.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(payloads[0])


def test_each_fault_is_logged_with_how_it_was_handled(client: httpx.Client) -> None:
    script(client, {"action": "status", "status": 500}, {"action": "malformed"})
    client.post(CHAT, json=QUESTION)
    client.post(CHAT, json=QUESTION)
    client.post(CHAT, json=QUESTION)

    entries = client.get("/_control/requests").json()["requests"]

    assert [entry["handled_as"] for entry in entries] == ["status", "malformed", "default"]
