"""Which model vendors does this deployment use, in which order, for which tier?

Vendors are configuration, not code: every one speaks OpenAI chat-completions, so
a provider is a base URL, the *name* of the environment variable holding its key,
a model per tier, a timeout and a few quirks. A preset (`preset: groq`) fills the
base URL, key variable and quirks of a known vendor; anything written next to it
wins. The file is YAML, named by CAIRN_GATEWAY_CONFIG; without it the gateway uses
one provider, the offline demo model.

Parsing is strict (unknown keys are refused), because a misspelt `timout_seconds`
silently falling back to a default is the kind of mistake found only in an outage.
The key itself never enters this module: it is read by the provider that uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

import yaml

from cairn_gateway.errors import ConfigInvalid

Tier = Literal["fast", "balanced", "deep"]
TIERS: tuple[Tier, ...] = get_args(Tier)
MaxTokensField = Literal["max_tokens", "max_completion_tokens"]
_MAX_TOKENS_FIELDS: tuple[str, ...] = get_args(MaxTokensField)

OFFLINE_MODEL = "cairn-offline-demo"
DEFAULT_OFFLINE_URL = "http://127.0.0.1:8089/v1"
DEFAULT_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often, and how patiently, one call retries one provider before failing over.

    Defaults follow the OpenAI SDK's: two retries, backoff from half a second. A
    Retry-After longer than `max_wait_seconds` is not waited for: the call fails over,
    or returns RESOURCE_EXHAUSTED with the provider's retry time when it cannot.
    """

    max_retries: int = 2
    backoff_seconds: float = 0.5
    max_wait_seconds: float = 8.0


@dataclass(frozen=True, slots=True)
class CooldownPolicy:
    """When a provider that keeps failing is left alone, and for how long.

    After `after_failures` retryable failures in a row it is skipped for
    `base_seconds`; each further cooldown before a success doubles that, up to
    `max_seconds`. A Retry-After also cools the provider for that long (capped the
    same way). `max_seconds: 0` turns cooldowns off.
    """

    after_failures: int = 3
    base_seconds: float = 5.0
    max_seconds: float = 300.0


@dataclass(frozen=True, slots=True)
class Preset:
    base_url: str
    api_key_env: str
    # OpenAI's reasoning models refuse `max_tokens`; every other vendor here takes it.
    max_tokens_field: MaxTokensField = "max_tokens"


PRESETS: Mapping[str, Preset] = {
    "openai": Preset("https://api.openai.com/v1", "OPENAI_API_KEY", "max_completion_tokens"),
    "groq": Preset("https://api.groq.com/openai/v1", "GROQ_API_KEY"),
    "gemini": Preset("https://generativelanguage.googleapis.com/v1beta/openai", "GEMINI_API_KEY"),
    "openrouter": Preset("https://openrouter.ai/api/v1", "OPENROUTER_API_KEY"),
    "together": Preset("https://api.together.xyz/v1", "TOGETHER_API_KEY"),
    "vllm": Preset("http://127.0.0.1:8000/v1", ""),
    "ollama": Preset("http://127.0.0.1:11434/v1", ""),
}


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    name: str
    base_url: str
    # The NAME of the variable holding the key; empty for servers that need none.
    api_key_env: str
    models: Mapping[Tier, str]
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    offline_demo: bool = False
    supports_reasoning_effort: bool = False
    max_tokens_field: MaxTokensField = "max_tokens"
    embedding_model: str = ""
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    preset: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    retry: RetryPolicy = RetryPolicy()
    cooldown: CooldownPolicy = CooldownPolicy()

    def model_for(self, tier: Tier) -> str | None:
        return self.models.get(tier)

    def tiers_of(self, model: str) -> tuple[Tier, ...]:
        return tuple(tier for tier in TIERS if self.models.get(tier) == model)

    @property
    def chat_models(self) -> tuple[str, ...]:
        """Distinct models in tier order."""
        return tuple(dict.fromkeys(self.models[tier] for tier in TIERS if tier in self.models))

    @property
    def has_ceiling(self) -> bool:
        return self.tokens_per_minute is not None or self.requests_per_minute is not None


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    providers: tuple[ProviderConfig, ...]
    # Where the configuration came from, for the start-up log line.
    source: str


def offline_default(offline_url: str = DEFAULT_OFFLINE_URL) -> GatewayConfig:
    """The configuration with no file: the offline demo model, labelled as such."""
    return GatewayConfig(
        providers=(
            ProviderConfig(
                name="offline",
                base_url=offline_url.rstrip("/"),
                api_key_env="",
                models=dict.fromkeys(TIERS, OFFLINE_MODEL),
                timeout_seconds=DEFAULT_TIMEOUT_SECONDS,
                offline_demo=True,
            ),
        ),
        source="embedded default (offline demo model)",
    )


_PROVIDER_KEYS = (
    "name",
    "preset",
    "base_url",
    "api_key_env",
    "models",
    "timeout_seconds",
    "offline_demo",
    "supports_reasoning_effort",
    "max_tokens_field",
    "embedding_model",
    "tokens_per_minute",
    "requests_per_minute",
    "headers",
    "max_retries",
    "retry_backoff_seconds",
    "retry_max_wait_seconds",
    "cooldown_after_failures",
    "cooldown_seconds",
    "cooldown_max_seconds",
)


def parse_config(text: str, *, source: str) -> GatewayConfig:
    """Parse the YAML provider file; ConfigInvalid names the bad key and what is accepted."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigInvalid(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict) or set(document) - {"providers"}:
        raise ConfigInvalid(
            f"{source}: the file must be a mapping with one key, 'providers' (a list), "
            f"got {_shown(document)}"
        )
    raw_providers = document.get("providers")
    if not isinstance(raw_providers, list) or not raw_providers:
        raise ConfigInvalid(
            f"{source}: 'providers' must be a non-empty list, in failover order, "
            f"got {_shown(raw_providers)}"
        )
    providers = tuple(
        _parse_provider(raw, where=f"{source}: providers[{index}]")
        for index, raw in enumerate(raw_providers)
    )
    names = [p.name for p in providers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigInvalid(f"{source}: provider names must be unique, {duplicates!r} repeat")
    return GatewayConfig(providers=providers, source=source)


def _parse_provider(raw: object, *, where: str) -> ProviderConfig:
    if not isinstance(raw, dict):
        raise ConfigInvalid(f"{where} must be a mapping, got {_shown(raw)}")
    unknown = sorted(set(raw) - set(_PROVIDER_KEYS))
    if unknown:
        raise ConfigInvalid(
            f"{where}: unknown key(s) {unknown!r}; accepted keys: {', '.join(_PROVIDER_KEYS)}"
        )
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigInvalid(f"{where}.name must be a non-empty string, got {_shown(name)}")
    where = f"{where} ({name})"

    preset_name = raw.get("preset", "")
    if not isinstance(preset_name, str) or (preset_name and preset_name not in PRESETS):
        raise ConfigInvalid(
            f"{where}.preset {preset_name!r} is not known; use one of {', '.join(PRESETS)} "
            "or leave it out and give base_url and api_key_env"
        )
    preset = PRESETS.get(preset_name)

    base_url = raw.get("base_url", preset.base_url if preset else None)
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ConfigInvalid(
            f"{where}.base_url must be an http(s) URL of an OpenAI-compatible API "
            f"(e.g. https://api.openai.com/v1), got {_shown(base_url)}"
        )
    api_key_env = raw.get("api_key_env", preset.api_key_env if preset else "")
    if api_key_env is None:
        api_key_env = ""
    if not isinstance(api_key_env, str) or (api_key_env and not api_key_env.isidentifier()):
        raise ConfigInvalid(
            f"{where}.api_key_env must be the NAME of an environment variable "
            f"(e.g. GROQ_API_KEY), or empty for a server without keys, got {_shown(api_key_env)}"
        )

    models = _parse_models(raw.get("models"), where=f"{where}.models")
    timeout = raw.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ConfigInvalid(
            f"{where}.timeout_seconds must be a number of seconds > 0, got {_shown(timeout)}"
        )
    max_tokens_field = raw.get(
        "max_tokens_field", preset.max_tokens_field if preset else "max_tokens"
    )
    if max_tokens_field not in _MAX_TOKENS_FIELDS:
        raise ConfigInvalid(
            f"{where}.max_tokens_field must be one of {', '.join(_MAX_TOKENS_FIELDS)}, "
            f"got {_shown(max_tokens_field)}"
        )
    embedding_model = raw.get("embedding_model", "")
    if not isinstance(embedding_model, str):
        raise ConfigInvalid(
            f"{where}.embedding_model must be a model name, got {_shown(embedding_model)}"
        )
    headers = raw.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise ConfigInvalid(
            f"{where}.headers must map header names to strings, got {_shown(headers)}"
        )
    if any(k.lower() == "authorization" for k in headers):
        raise ConfigInvalid(
            f"{where}.headers must not carry 'Authorization'; name the key's variable "
            "in api_key_env so the key stays out of the file"
        )
    defaults_retry, defaults_cooldown = RetryPolicy(), CooldownPolicy()
    retry = RetryPolicy(
        max_retries=_whole(raw, "max_retries", defaults_retry.max_retries, where=where),
        backoff_seconds=_seconds(
            raw, "retry_backoff_seconds", defaults_retry.backoff_seconds, where=where, zero=False
        ),
        max_wait_seconds=_seconds(
            raw, "retry_max_wait_seconds", defaults_retry.max_wait_seconds, where=where
        ),
    )
    after_failures = _whole(
        raw, "cooldown_after_failures", defaults_cooldown.after_failures, where=where
    )
    if after_failures == 0:
        raise ConfigInvalid(
            f"{where}.cooldown_after_failures must be at least 1; to turn cooldowns off "
            "set cooldown_max_seconds: 0"
        )
    cooldown = CooldownPolicy(
        after_failures=after_failures,
        base_seconds=_seconds(
            raw, "cooldown_seconds", defaults_cooldown.base_seconds, where=where, zero=False
        ),
        max_seconds=_seconds(
            raw, "cooldown_max_seconds", defaults_cooldown.max_seconds, where=where
        ),
    )
    return ProviderConfig(
        name=name.strip(),
        base_url=base_url.rstrip("/"),
        api_key_env=api_key_env,
        models=models,
        timeout_seconds=float(timeout),
        offline_demo=_bool(raw, "offline_demo", where=where),
        supports_reasoning_effort=_bool(raw, "supports_reasoning_effort", where=where),
        max_tokens_field=max_tokens_field,
        embedding_model=embedding_model,
        tokens_per_minute=_positive_int(raw, "tokens_per_minute", where=where),
        requests_per_minute=_positive_int(raw, "requests_per_minute", where=where),
        preset=preset_name,
        headers=dict(headers),
        retry=retry,
        cooldown=cooldown,
    )


def _parse_models(raw: object, *, where: str) -> dict[Tier, str]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigInvalid(
            f"{where} must map tiers ({', '.join(TIERS)}) to model names, got {_shown(raw)}"
        )
    models: dict[Tier, str] = {}
    for tier, model in raw.items():
        if tier not in TIERS:
            raise ConfigInvalid(f"{where}: tier {tier!r} is not known; use {', '.join(TIERS)}")
        if not isinstance(model, str) or not model.strip():
            raise ConfigInvalid(f"{where}.{tier} must be a model name, got {_shown(model)}")
        models[tier] = model.strip()
    return models


def _bool(raw: Mapping[str, object], key: str, *, where: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ConfigInvalid(f"{where}.{key} must be true or false, got {_shown(value)}")
    return value


def _positive_int(raw: Mapping[str, object], key: str, *, where: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigInvalid(f"{where}.{key} must be a whole number > 0, got {_shown(value)}")
    return value


def _whole(raw: Mapping[str, object], key: str, default: int, *, where: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigInvalid(f"{where}.{key} must be a whole number >= 0, got {_shown(value)}")
    return value


def _seconds(
    raw: Mapping[str, object], key: str, default: float, *, where: str, zero: bool = True
) -> float:
    value = raw.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or value < 0
        or (value == 0 and not zero)
    ):
        bound = ">= 0" if zero else "> 0"
        raise ConfigInvalid(
            f"{where}.{key} must be a number of seconds {bound}, got {_shown(value)}"
        )
    return float(value)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
