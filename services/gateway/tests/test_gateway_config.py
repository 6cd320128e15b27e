"""The provider file: presets, defaults, strictness, and the offline default."""

from __future__ import annotations

import traceback
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
        (
            "providers:\n  - name: a\n    base_url: ftp://x\n    models: {fast: m}",
            "must start with http:// or https://",
        ),
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


def one_provider(*lines: str) -> str:
    body = "".join(f"\n    {line}" for line in lines)
    return f"providers:\n  - name: groq-main{body}"


@pytest.mark.parametrize(
    ("base_url", "fix"),
    [
        ("https://api.groq.com/openai/v1/chat/completions", "https://api.groq.com/openai/v1"),
        ("https://api.groq.com/openai/v1/chat/completions/", "https://api.groq.com/openai/v1"),
        ("https://api.openai.com/v1/embeddings", "https://api.openai.com/v1"),
        ("http://gpu-7:8000/v1/completions", "http://gpu-7:8000/v1"),
        ("http://gpu-7:8000/v1/models", "http://gpu-7:8000/v1"),
        ("https://openrouter.ai/api/v1/Chat/Completions", "https://openrouter.ai/api/v1"),
    ],
)
def test_a_base_url_ending_in_an_endpoint_the_gateway_appends_is_refused_with_the_fix(
    base_url: str, fix: str
) -> None:
    with pytest.raises(ConfigInvalid) as refused:
        parse_config(
            one_provider(f"base_url: {base_url}", "models: {fast: m}"), source="providers.yaml"
        )

    message = refused.value.message
    assert "(groq-main).base_url" in message
    assert repr(base_url.rstrip("/")) in message
    assert f"write {fix!r}" in message


@pytest.mark.parametrize(
    ("lines", "names"),
    [
        (("base_url: api.groq.com/openai/v1", "models: {fast: m}"), "http:// or https://"),
        (("base_url: https:///v1", "models: {fast: m}"), "names no host"),
        (("base_url: 'https://x/v1?key=1'", "models: {fast: m}"), "without spaces, a query"),
        (("base_url: https://x:port/v1", "models: {fast: m}"), "is not a URL"),
        (("base_url: 42", "models: {fast: m}"), "base_url must be the http(s) URL"),
        (("preset: groq", "timeout_seconds: .nan", "models: {fast: m}"), "timeout_seconds"),
        (("preset: groq", "timeout_seconds: .inf", "models: {fast: m}"), "timeout_seconds"),
        (("preset: groq", "cooldown_seconds: .nan", "models: {fast: m}"), "cooldown_seconds"),
        (("preset: groq", "retry_max_wait_seconds: -.inf", "models: {fast: m}"), "max_wait"),
        (("preset: groq", "tokens_per_minute: 0", "models: {fast: m}"), "tokens_per_minute"),
        (("preset: groq", "requests_per_minute: 1.5", "models: {fast: m}"), "requests_per_minute"),
        (("preset: groq", "models: {fast: '  '}"), "fast must be a non-empty model name"),
        (("preset: groq", "models: {fast: [a, b]}"), "fast must be a non-empty model name"),
        (("preset: groq", "models: [fast]"), "must map tiers"),
        (("preset: groq", "embedding_model: 3", "models: {fast: m}"), "embedding_model"),
        (("preset: groq", "offline_demo: 'yes'", "models: {fast: m}"), "true or false"),
        (("preset: 7", "models: {fast: m}"), "preset 7 is not known"),
        (("preset: groq", "headers: [a]", "models: {fast: m}"), "headers must map"),
        (("preset: groq", "headers: {'bad name': x}", "models: {fast: m}"), "HTTP header name"),
        (
            ("preset: groq", "models: {fast: m}", "timeout_seconds: 5", "timeout_seconds: 50"),
            "'timeout_seconds' is written twice",
        ),
        (("preset: groq", "models: {fast: m}", "models: {deep: n}"), "'models' is written twice"),
    ],
)
def test_each_mistake_in_a_provider_is_refused_at_start_up_naming_it(
    lines: tuple[str, ...], names: str
) -> None:
    with pytest.raises(ConfigInvalid) as refused:
        parse_config(one_provider(*lines), source="providers.yaml")

    assert names in refused.value.message
    assert refused.value.message.startswith("providers.yaml")


def test_a_control_character_in_a_provider_name_is_refused() -> None:
    with pytest.raises(ConfigInvalid, match="without control characters"):
        parse_config(
            'providers:\n  - name: "a\\0b"\n    preset: groq\n    models: {fast: m}\n',
            source="providers.yaml",
        )


def test_names_are_compared_after_trimming_so_a_padded_duplicate_is_refused() -> None:
    with pytest.raises(ConfigInvalid, match=r"\['a'\] repeat"):
        parse_config(
            "providers:\n  - {name: a, preset: groq, models: {fast: m}}\n"
            "  - {name: ' a ', preset: groq, models: {fast: m}}\n",
            source="providers.yaml",
        )


SECRET = "gsk_0123456789abcdefSECRETSECRET"


@pytest.mark.parametrize(
    "lines",
    [
        (f"api_key_env: {SECRET}", "base_url: https://x/v1", "models: {fast: m}"),
        (f"api_key_env: 'Bearer {SECRET}'", "base_url: https://x/v1", "models: {fast: m}"),
        (f"base_url: https://user:{SECRET}@x/v1", "models: {fast: m}"),
        (
            "base_url: https://x/v1",
            f'headers: {{api-key: "{SECRET}\\n"}}',
            "models: {fast: m}",
        ),
    ],
)
def test_a_key_written_where_it_does_not_belong_is_refused_without_repeating_it(
    lines: tuple[str, ...],
) -> None:
    with pytest.raises(ConfigInvalid) as refused:
        parse_config(one_provider(*lines), source="providers.yaml")

    assert "(groq-main)" in refused.value.message
    assert SECRET not in refused.value.message and SECRET[:12] not in refused.value.message


def test_a_refused_key_is_not_repeated_in_the_refusals_traceback_either() -> None:
    with pytest.raises(ConfigInvalid) as refused:
        parse_config(
            one_provider(f"api_key_env: {SECRET}", "base_url: https://x/v1", "models: {fast: m}"),
            source="providers.yaml",
        )

    shown = "".join(traceback.format_exception(refused.value))
    assert "api_key_env" in shown
    assert SECRET not in shown and SECRET[:12] not in shown


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

    providers, unusable = build_providers(config, {"GROQ_API_KEY": "  "})

    assert [p.config.name for p in providers] == ["o"]
    assert [(u.config.name, u.reason) for u in unusable] == [
        ("g", "its key variable GROQ_API_KEY is not set")
    ]
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


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("127.0.0.1:8089/v1", "http:// or https://"),
        ("http://127.0.0.1:8089/v1/chat/completions", "write 'http://127.0.0.1:8089/v1'"),
    ],
)
def test_an_offline_model_url_that_cannot_work_is_refused_at_start_up(url: str, names: str) -> None:
    with pytest.raises(ConfigInvalid) as refused:
        load_config({"CAIRN_OFFLINE_MODEL_URL": url})

    assert refused.value.message.startswith("CAIRN_OFFLINE_MODEL_URL")
    assert names in refused.value.message


def test_a_provider_file_that_is_not_utf8_text_is_refused_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "providers.yaml"
    config.write_bytes(b"providers:\n  - name: \xff\xfe\n")

    with pytest.raises(ConfigInvalid) as refused:
        load_config({"CAIRN_GATEWAY_CONFIG": str(config)})

    assert f"CAIRN_GATEWAY_CONFIG={str(config)!r}" in refused.value.message
    assert "UTF-8" in refused.value.message
