"""The fake provider as a process: its listening line, its flags, its exit."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import pytest

from cairn_fakeprovider.launch import FakeProviderProcess

StartProvider = Callable[..., FakeProviderProcess]
QUESTION = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CHAT = "/v1/chat/completions"


def test_listening_line_reports_the_real_port_and_the_name(start_provider: StartProvider) -> None:
    provider = start_provider("--name", "primary")

    assert provider.name == "primary"
    assert provider.port > 0
    models = httpx.get(f"{provider.base_url}/v1/models", timeout=5)
    assert models.status_code == 200


def test_server_exits_cleanly_on_sigterm(start_provider: StartProvider) -> None:
    provider = start_provider()

    assert provider.stop() == 0


def test_server_exits_cleanly_on_sigint_even_with_a_request_hanging(
    start_provider: StartProvider,
) -> None:
    provider = start_provider()
    httpx.post(
        f"{provider.base_url}/_control/script", json={"steps": [{"action": "hang", "seconds": 60}]}
    )
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{provider.base_url}{CHAT}", json=QUESTION, timeout=0.3)

    provider.process.send_signal(signal.SIGINT)

    assert provider.process.wait(timeout=10) == 0


def test_required_key_refuses_a_missing_or_wrong_bearer_with_401(
    start_provider: StartProvider,
) -> None:
    provider = start_provider("--require-key", "sk-test-key")
    url = f"{provider.base_url}{CHAT}"

    missing = httpx.post(url, json=QUESTION, timeout=5)
    wrong = httpx.post(url, json=QUESTION, headers={"Authorization": "Bearer sk-nope"}, timeout=5)
    right = httpx.post(
        url, json=QUESTION, headers={"Authorization": "Bearer sk-test-key"}, timeout=5
    )

    for refused in (missing, wrong):
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert "sk-nope" not in refused.text
    assert right.status_code == 200
    assert httpx.get(f"{provider.base_url}/v1/models", timeout=5).status_code == 401


def test_latency_ms_delays_every_answer(start_provider: StartProvider) -> None:
    provider = start_provider("--latency-ms", "300")

    started = time.monotonic()
    response = httpx.post(f"{provider.base_url}{CHAT}", json=QUESTION, timeout=5)

    assert response.status_code == 200
    assert time.monotonic() - started >= 0.3
