"""The provider file: presets, defaults, strictness, and the offline default."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from cairn_gateway.app import build_providers, load_config
from cairn_gateway.config import PRESETS, offline_default, parse_config
from cairn_gateway.errors import (
    CallExceedsCeiling,
    ChatRequestInvalid,
    ConfigInvalid,
    LedgerUnavailable,
    NoProviderConfigured,
    ProviderCredentialRejected,
    ProviderRateLimited,
    ProviderRejectedRequest,
    ProviderUnavailable,
    RunBudgetExceeded,
    StreamCut,
)
from cairn_libs.server import to_rpc_status

EXAMPLE = Path(__file__).resolve().parents[1] / "providers.example.yaml"


def test_a_preset_fills_base_url_and_key_variable() -> None:
    config = parse_config(
        "providers:\n  - name: g\n    preset: groq\n    models: {fast: llama-3.1-8b-instant}\n",
        source="test",
    )

    (groq,) = config.providers
    assert groq.base_url == "https://api.groq.com/openai/v1"
    assert groq.api_key_env == "GROQ_API_KEY"
    assert groq.model_for("fast") == "llama-3.1-8b-instant"
    assert groq.model_for("deep") is None
    assert groq.supports_reasoning_effort is False


def test_keys_written_next_to_a_preset_win() -> None:
    config = parse_config(
        "providers:\n  - name: v\n    preset: vllm\n    base_url: http://gpu-7:8000/v1/\n"
        "    api_key_env: VLLM_KEY\n    models: {deep: qwen}\n",
        source="test",
    )

    (vllm,) = config.providers
    assert (vllm.base_url, vllm.api_key_env) == ("http://gpu-7:8000/v1", "VLLM_KEY")


def test_every_preset_named_in_the_design_exists() -> None:
    assert set(PRESETS) == {"openai", "groq", "gemini", "openrouter", "together", "vllm", "ollama"}
    assert PRESETS["gemini"].base_url == "https://generativelanguage.googleapis.com/v1beta/openai"
    assert PRESETS["ollama"].api_key_env == "" and PRESETS["vllm"].api_key_env == ""
    assert PRESETS["openai"].max_tokens_field == "max_completion_tokens"


def test_the_shipped_example_parses() -> None:
    config = parse_config(EXAMPLE.read_text(), source=str(EXAMPLE))

    assert [p.name for p in config.providers][:2] == ["groq", "gemini"]
    assert config.providers[0].tokens_per_minute == 8000


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("providers: []", "'providers' must be a non-empty list"),
        ("provider: []", "one key, 'providers'"),
        ("providers:\n  - name: a\n    preset: grok\n    models: {fast: m}", "'grok' is not known"),
        ("providers:\n  - name: a\n    base_url: ftp://x\n    models: {fast: m}", "http(s) URL"),
        ("providers:\n  - name: a\n    preset: groq\n    models: {quick: m}", "tier 'quick'"),
        ("providers:\n  - name: a\n    preset: groq\n    models: {}", "must map tiers"),
        (
            "providers:\n  - name: a\n    preset: groq\n    timout_seconds: 3\n    models: {fast: m}",
            "['timout_seconds']",
        ),
        (
            "providers:\n  - name: a\n    preset: groq\n    timeout_seconds: 0\n    models: {fast: m}",
            "timeout_seconds",
        ),
        (
            "providers:\n  - name: a\n    preset: groq\n    api_key_env: sk-live-123\n    models: {fast: m}",
            "NAME of an environment variable",
        ),
        (
            "providers:\n  - name: a\n    preset: groq\n    headers: {Authorization: Bearer x}\n    models: {fast: m}",
            "must not carry 'Authorization'",
        ),
        (
            "providers:\n  - {name: a, preset: groq, models: {fast: m}}\n  - {name: a, preset: groq, models: {fast: m}}",
            "['a'] repeat",
        ),
        (
            "providers:\n  - name: a\n    preset: groq\n    tokens_per_minute: -5\n    models: {fast: m}",
            "tokens_per_minute",
        ),
        (
            "providers:\n  - name: a\n    preset: groq\n    max_retries: -1\n    models: {fast: m}",
            "max_retries must be a whole number >= 0",
        ),
        (
            "providers:\n  - name: a\n    preset: groq\n    retry_backoff_seconds: 0\n    models: {fast: m}",
            "retry_backoff_seconds must be a number of seconds > 0",
        ),
        (
            "providers:\n  - name: a\n    preset: groq\n    cooldown_after_failures: 0\n    models: {fast: m}",
            "set cooldown_max_seconds: 0",
        ),
        (
            "providers:\n  - name: a\n    preset: groq\n    cooldown_max_seconds: soon\n    models: {fast: m}",
            "cooldown_max_seconds must be a number of seconds >= 0",
        ),
        ("providers: [", "not valid YAML"),
    ],
)
def test_a_bad_provider_file_is_refused_naming_what_is_wrong(text: str, names: str) -> None:
    with pytest.raises(ConfigInvalid) as refused:
        parse_config(text, source="providers.yaml")

    assert names in refused.value.message
    assert refused.value.message.startswith("providers.yaml")


def test_retries_and_cooldowns_default_sensibly_and_are_set_per_provider() -> None:
    config = parse_config(
        "providers:\n  - {name: g, preset: groq, models: {fast: m}}\n"
        "  - name: o\n    preset: ollama\n    models: {fast: m}\n    max_retries: 0\n"
        "    retry_backoff_seconds: 0.1\n    retry_max_wait_seconds: 2\n"
        "    cooldown_after_failures: 5\n    cooldown_seconds: 1\n    cooldown_max_seconds: 0\n",
        source="test",
    )

    default, tuned = config.providers
    assert (default.retry.max_retries, default.retry.backoff_seconds) == (2, 0.5)
    assert default.retry.max_wait_seconds == 8
    assert (default.cooldown.after_failures, default.cooldown.base_seconds) == (3, 5)
    assert default.cooldown.max_seconds == 300
    assert (tuned.retry.max_retries, tuned.retry.backoff_seconds) == (0, 0.1)
    assert tuned.retry.max_wait_seconds == 2
    assert (tuned.cooldown.after_failures, tuned.cooldown.max_seconds) == (5, 0)


def test_without_a_file_the_gateway_uses_the_offline_demo_model() -> None:
    config = load_config({"CAIRN_OFFLINE_MODEL_URL": "http://127.0.0.1:9999/v1/"})

    (offline,) = config.providers
    assert offline.name == "offline" and offline.offline_demo
    assert offline.base_url == "http://127.0.0.1:9999/v1"
    assert {offline.model_for(t) for t in ("fast", "balanced", "deep")} == {"cairn-offline-demo"}
    assert offline_default().providers[0].base_url == "http://127.0.0.1:8089/v1"


def test_a_config_path_that_cannot_be_read_is_refused() -> None:
    with pytest.raises(ConfigInvalid, match="cannot be read"):
        load_config({"CAIRN_GATEWAY_CONFIG": "/nonexistent/providers.yaml"})


async def test_a_provider_whose_key_variable_is_unset_is_left_out_with_the_reason() -> None:
    config = parse_config(
        "providers:\n  - {name: g, preset: groq, models: {fast: m}}\n"
        "  - {name: o, preset: ollama, models: {fast: m}}\n",
        source="test",
    )

    providers, disabled = build_providers(config, {"GROQ_API_KEY": "  "})

    assert [p.config.name for p in providers] == ["o"]
    assert disabled == {"g": "its key variable GROQ_API_KEY is not set"}
    for provider in providers:
        await provider.aclose()


@pytest.mark.parametrize(
    ("error", "code", "retry"),
    [
        (ChatRequestInvalid("x"), grpc.StatusCode.INVALID_ARGUMENT, False),
        (ProviderRejectedRequest("x"), grpc.StatusCode.INVALID_ARGUMENT, False),
        (ProviderCredentialRejected("x"), grpc.StatusCode.FAILED_PRECONDITION, False),
        (RunBudgetExceeded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        (CallExceedsCeiling("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, False),
        (
            ProviderRateLimited("x", retry_after_seconds=2.5),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            True,
        ),
        (ProviderUnavailable("x"), grpc.StatusCode.UNAVAILABLE, False),
        (StreamCut("x"), grpc.StatusCode.UNAVAILABLE, False),
        (LedgerUnavailable("x"), grpc.StatusCode.UNAVAILABLE, False),
        (NoProviderConfigured("x"), grpc.StatusCode.UNIMPLEMENTED, False),
        (ConfigInvalid("x"), grpc.StatusCode.UNIMPLEMENTED, False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "",
)
def test_every_gateway_error_maps_to_its_status(
    error: Exception, code: grpc.StatusCode, retry: bool
) -> None:
    status = to_rpc_status(error)

    assert status.code == code
    rich = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
    has_retry = any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in rich.details)
    assert has_retry is retry
