"""Which model vendors does this deployment use, in which order, for which tier?

Vendors are configuration, not code: every one speaks OpenAI chat-completions, so
a provider is a base URL, the *name* of the environment variable holding its key,
a model per tier, a timeout and a few quirks. A preset (`preset: groq`) fills the
base URL, key variable and quirks of a known vendor; anything written next to it
wins. The file is YAML, named by CAIRN_GATEWAY_CONFIG; without it the gateway uses
one provider, the offline demo model.

Parsing is strict, because a misspelt `timout_seconds` silently falling back to a
default is the kind of mistake found only in an outage: unknown keys, a key written
twice, wrong types, blank names, numbers that are negative, NaN or infinite, and a
base_url that already ends in the endpoint the gateway appends (`/chat/completions`)
are each refused at start-up, naming the provider, the key and what to write. The
key itself never enters this module (it is read by the provider that uses it), and
no message here repeats a value that might be one: api_key_env, header values and a
URL's user:password part are never echoed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, get_args
from urllib.parse import urlsplit

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


# Paths the wire appends to base_url (and their near relatives a vendor's docs show):
# a base_url ending in one makes every call go to ".../chat/completions/chat/completions",
# which vendors answer with 404, read as the caller's bad request.
ENDPOINT_SUFFIXES = (
    "/chat/completions",
    "/completions",
    "/embeddings",
    "/chat",
    "/models",
    "/responses",
)
# Prefixes of vendor keys, so a key pasted where its variable's NAME belongs is
# recognised (and never repeated in the message).
_KEY_PREFIXES = ("sk-", "sk_", "gsk_", "xai-", "hf_", "AIza", "pplx-", "nvapi-", "r8_")
# An HTTP header name (RFC 9110 token).
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class _StrictLoader(yaml.SafeLoader):
    """safe_load, except that a key written twice in one mapping is an error: PyYAML
    keeps the last silently, so a second `models:` would quietly replace the first."""


def _no_duplicate_keys(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Hashable, Any]:
    seen: dict[Hashable, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise ConfigInvalid(
                f"line {key_node.start_mark.line + 1}: key {key!r} is written twice in one "
                "mapping; keep one (YAML would silently use the last)"
            )
        seen[key] = loader.construct_object(value_node, deep=True)
    return seen


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _no_duplicate_keys,  # type: ignore[arg-type]
)


def parse_config(text: str, *, source: str) -> GatewayConfig:
    """Parse the YAML provider file; ConfigInvalid names the bad key and what is accepted."""
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except ConfigInvalid as exc:
        raise ConfigInvalid(f"{source}: {exc.message}") from exc
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
    if not isinstance(name, str) or not name.strip() or _CONTROL.search(name):
        raise ConfigInvalid(
            f"{where}.name must be a non-empty string without control characters, "
            f"got {_shown(name)}"
        )
    name = name.strip()
    where = f"{where} ({name})"

    preset_name = raw.get("preset", "")
    if not isinstance(preset_name, str) or (preset_name and preset_name not in PRESETS):
        raise ConfigInvalid(
            f"{where}.preset {preset_name!r} is not known; use one of {', '.join(PRESETS)} "
            "or leave it out and give base_url and api_key_env"
        )
    preset = PRESETS.get(preset_name)

    base_url = _base_url(raw.get("base_url", preset.base_url if preset else None), where=where)
    api_key_env = _key_variable(
        raw.get("api_key_env", preset.api_key_env if preset else ""), where=where
    )

    models = _parse_models(raw.get("models"), where=f"{where}.models")
    timeout = raw.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS)
    if not _finite(timeout) or timeout <= 0:
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
    if embedding_model is None:
        embedding_model = ""
    if not isinstance(embedding_model, str) or _CONTROL.search(embedding_model):
        raise ConfigInvalid(
            f"{where}.embedding_model must be a model name (or left out), "
            f"got {_shown(embedding_model)}"
        )
    headers = _headers(raw.get("headers", {}), where=where)
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
        name=name,
        base_url=base_url,
        api_key_env=api_key_env,
        models=models,
        timeout_seconds=float(timeout),
        offline_demo=_bool(raw, "offline_demo", where=where),
        supports_reasoning_effort=_bool(raw, "supports_reasoning_effort", where=where),
        max_tokens_field=max_tokens_field,
        embedding_model=embedding_model.strip(),
        tokens_per_minute=_positive_int(raw, "tokens_per_minute", where=where),
        requests_per_minute=_positive_int(raw, "requests_per_minute", where=where),
        preset=preset_name,
        headers=headers,
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
        if not isinstance(model, str) or not model.strip() or _CONTROL.search(model):
            raise ConfigInvalid(
                f"{where}.{tier} must be a non-empty model name, got {_shown(model)}"
            )
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
    if not _finite(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ConfigInvalid(
            f"{where}.{key} must be a number of seconds {bound}, got {_shown(value)}"
        )
    return float(value)


def check_base_url(value: object, *, where: str) -> str:
    """The URL as the gateway will use it (no trailing slash), or ConfigInvalid
    naming `where` and what is wrong with it."""
    return _base_url(value, where=where, key="")


def _base_url(value: object, *, where: str, key: str = ".base_url") -> str:
    example = "e.g. https://api.openai.com/v1"
    if not isinstance(value, str) or not value.strip():
        raise ConfigInvalid(
            f"{where}{key} must be the http(s) URL of an OpenAI-compatible API "
            f"({example}), got {_shown(value)}"
        )
    url = value.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError as exc:
        raise ConfigInvalid(f"{where}{key} {url!r} is not a URL ({exc}); {example}") from exc
    if parts.username is not None or parts.password is not None:
        # Not echoed: the part before '@' may well be a key.
        raise ConfigInvalid(
            f"{where}{key} must not carry a user or password (the part before '@'); "
            "name the key's variable in api_key_env instead"
        )
    if parts.scheme not in ("http", "https"):
        raise ConfigInvalid(f"{where}{key} {url!r} must start with http:// or https:// ({example})")
    if not parts.hostname:
        raise ConfigInvalid(f"{where}{key} {url!r} names no host ({example})")
    if parts.query or parts.fragment or _CONTROL.search(url) or " " in url:
        raise ConfigInvalid(
            f"{where}{key} {url!r} must be a plain URL, without spaces, a query (?...) "
            f"or a fragment (#...) ({example})"
        )
    url = url.rstrip("/")
    for suffix in ENDPOINT_SUFFIXES:
        if url.lower().endswith(suffix):
            root = url[: -len(suffix)]
            raise ConfigInvalid(
                f"{where}{key} {url!r} ends in {suffix!r}, which the gateway appends "
                f"itself (it calls <base_url>/chat/completions and <base_url>/embeddings); "
                f"write {root!r}"
            )
    return url


def _key_variable(value: object, *, where: str) -> str:
    if value is None:
        return ""
    what = (
        f"{where}.api_key_env must be the NAME of an environment variable that holds the "
        "key (e.g. GROQ_API_KEY), or empty for a server without keys"
    )
    if not isinstance(value, str):
        raise ConfigInvalid(f"{what}; got {type(value).__name__}")
    name = value.strip()
    # The value is never repeated: a key pasted here must not reach the log.
    if name.startswith(_KEY_PREFIXES):
        raise ConfigInvalid(
            f"{what}; the value given looks like a key itself (not shown). Put the key in "
            "an environment variable and write that variable's name here"
        )
    if name and not name.isidentifier():
        raise ConfigInvalid(
            f"{what}; the value given is not a variable name (letters, digits and _ only; "
            "not shown, in case it is the key)"
        )
    return name


def _headers(value: object, *, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigInvalid(
            f"{where}.headers must map header names to strings, got {type(value).__name__}"
        )
    headers: dict[str, str] = {}
    for header, text in value.items():
        # Values are never shown: a vendor's own key header (api-key) may be among them.
        if not isinstance(header, str) or not _HEADER_NAME.match(header):
            raise ConfigInvalid(
                f"{where}.headers: {_shown(header)} is not an HTTP header name "
                "(letters, digits and -, e.g. HTTP-Referer)"
            )
        if header.lower() == "authorization":
            raise ConfigInvalid(
                f"{where}.headers must not carry 'Authorization'; name the key's variable "
                "in api_key_env so the key stays out of the file"
            )
        if not isinstance(text, str) or _CONTROL.search(text):
            raise ConfigInvalid(
                f"{where}.headers.{header} must be text on one line (no control "
                f"characters), got a {type(text).__name__} (value not shown)"
            )
        headers[header] = text
    return headers


def _finite(value: object) -> TypeGuard[int | float]:
    """A number YAML wrote as one (not true/false), and neither .nan nor .inf."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
