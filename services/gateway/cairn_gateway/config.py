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
file's shape is declared once, as pydantic models with unknown keys forbidden
(`ProviderFile`, `ProviderEntry`); pydantic's errors are put back into the file's
own words (`_refused`), since its defaults would repeat values and name no fix. The
key itself never enters this module (it is read by the provider that uses it), and
no message here repeats a value that might be one: api_key_env, header values and a
URL's user:password part are never echoed.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

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
_URL_EXAMPLE = "e.g. https://api.openai.com/v1"
_RETRY = RetryPolicy()
_COOLDOWN = CooldownPolicy()


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


# --- the file, declared ----------------------------------------------------------
#
# Each key of a provider is a field of `ProviderEntry`. A field's description says
# what it accepts, and any mistake in it is reported as "<where>.<key> <description>,
# got <value>"; keys whose mistakes need words of their own (which must never repeat
# a value that may be a key, or that say how to fix a URL) raise `_refusal` from
# their validator, and the text follows the key's path as it is.


def _refusal(tail: str) -> PydanticCustomError:
    """A mistake in our own words, said right after the path of the key it is about;
    `tail` starts with its own separator (" must be ...", ": tier 'x' ...")."""
    return PydanticCustomError("cairn_config", "{tail}", {"tail": tail})


def _name(value: str) -> str:
    if not value.strip() or _CONTROL.search(value):
        raise ValueError("a blank name or a control character")
    return value.strip()


def _preset(value: object) -> str:
    if not isinstance(value, str) or (value and value not in PRESETS):
        raise _refusal(
            f" {value!r} is not known; use one of {', '.join(PRESETS)} "
            "or leave it out and give base_url and api_key_env"
        )
    return value


def _base_url(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _refusal(
            f" must be the http(s) URL of an OpenAI-compatible API ({_URL_EXAMPLE}), "
            f"got {_shown(value)}"
        )
    url = value.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError as exc:
        raise _refusal(f" {url!r} is not a URL ({exc}); {_URL_EXAMPLE}") from exc
    if parts.username is not None or parts.password is not None:
        # Not echoed: the part before '@' may well be a key.
        raise _refusal(
            " must not carry a user or password (the part before '@'); "
            "name the key's variable in api_key_env instead"
        )
    if parts.scheme not in ("http", "https"):
        raise _refusal(f" {url!r} must start with http:// or https:// ({_URL_EXAMPLE})")
    if not parts.hostname:
        raise _refusal(f" {url!r} names no host ({_URL_EXAMPLE})")
    if parts.query or parts.fragment or _CONTROL.search(url) or " " in url:
        raise _refusal(
            f" {url!r} must be a plain URL, without spaces, a query (?...) "
            f"or a fragment (#...) ({_URL_EXAMPLE})"
        )
    url = url.rstrip("/")
    for suffix in ENDPOINT_SUFFIXES:
        if url.lower().endswith(suffix):
            root = url[: -len(suffix)]
            raise _refusal(
                f" {url!r} ends in {suffix!r}, which the gateway appends "
                f"itself (it calls <base_url>/chat/completions and <base_url>/embeddings); "
                f"write {root!r}"
            )
    return url


def _key_variable(value: object) -> str:
    if value is None:
        return ""
    what = (
        " must be the NAME of an environment variable that holds the "
        "key (e.g. GROQ_API_KEY), or empty for a server without keys"
    )
    if not isinstance(value, str):
        raise _refusal(f"{what}; got {type(value).__name__}")
    name = value.strip()
    # The value is never repeated: a key pasted here must not reach the log.
    if name.startswith(_KEY_PREFIXES):
        raise _refusal(
            f"{what}; the value given looks like a key itself (not shown). Put the key in "
            "an environment variable and write that variable's name here"
        )
    if name and not name.isidentifier():
        raise _refusal(
            f"{what}; the value given is not a variable name (letters, digits and _ only; "
            "not shown, in case it is the key)"
        )
    return name


def _tier(value: object) -> Tier:
    for tier in TIERS:
        if value == tier:
            return tier
    raise _refusal(f": tier {value!r} is not known; use {', '.join(TIERS)}")


def _model_name(value: object) -> str:
    if not isinstance(value, str) or not value.strip() or _CONTROL.search(value):
        raise _refusal(f" must be a non-empty model name, got {_shown(value)}")
    return value.strip()


def _embedding_model(value: str | None) -> str:
    if value is not None and _CONTROL.search(value):
        raise ValueError("a control character")
    return (value or "").strip()


def _headers(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refusal(f" must map header names to strings, got {type(value).__name__}")
    headers: dict[str, str] = {}
    for header, text in value.items():
        # Values are never shown: a vendor's own key header (api-key) may be among them.
        if not isinstance(header, str) or not _HEADER_NAME.match(header):
            raise _refusal(
                f": {_shown(header)} is not an HTTP header name "
                "(letters, digits and -, e.g. HTTP-Referer)"
            )
        if header.lower() == "authorization":
            raise _refusal(
                " must not carry 'Authorization'; name the key's variable "
                "in api_key_env so the key stays out of the file"
            )
        if not isinstance(text, str) or _CONTROL.search(text):
            raise _refusal(
                f".{header} must be text on one line (no control "
                f"characters), got a {type(text).__name__} (value not shown)"
            )
        headers[header] = text
    return headers


def _at_least_one_failure(value: int) -> int:
    if value == 0:
        raise _refusal(" must be at least 1; to turn cooldowns off set cooldown_max_seconds: 0")
    return value


_WHOLE = "must be a whole number >= 0"
_POSITIVE_WHOLE = "must be a whole number > 0"
_SECONDS = "must be a number of seconds >= 0"
_POSITIVE_SECONDS = "must be a number of seconds > 0"
_TRUE_OR_FALSE = "must be true or false"


class ProviderEntry(BaseModel):
    """One entry of the file's `providers:` list, as written. Fields are declared in
    the order they are checked, so the first mistake reported is the first one met."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Annotated[str, AfterValidator(_name)] = Field(
        description="must be a non-empty string without control characters"
    )
    preset: Annotated[str, PlainValidator(_preset)] = Field(
        "", description=f"one of {', '.join(PRESETS)}, or left out"
    )
    base_url: Annotated[str, PlainValidator(_base_url)] = Field(
        description=f"must be the http(s) URL of an OpenAI-compatible API ({_URL_EXAMPLE})"
    )
    api_key_env: Annotated[str, PlainValidator(_key_variable)] = Field(
        "", description="the NAME of the variable holding the key, or empty"
    )
    models: Annotated[
        dict[Annotated[Tier, PlainValidator(_tier)], Annotated[str, PlainValidator(_model_name)]],
        Field(min_length=1),
    ] = Field(description=f"must map tiers ({', '.join(TIERS)}) to model names")
    timeout_seconds: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        DEFAULT_TIMEOUT_SECONDS, description=_POSITIVE_SECONDS
    )
    max_tokens_field: MaxTokensField = Field(
        "max_tokens", description=f"must be one of {', '.join(_MAX_TOKENS_FIELDS)}"
    )
    embedding_model: Annotated[str | None, AfterValidator(_embedding_model)] = Field(
        "", description="must be a model name (or left out)"
    )
    headers: Annotated[dict[str, str], PlainValidator(_headers)] = Field(
        default_factory=dict, description="header names to text, never Authorization"
    )
    max_retries: Annotated[int, Field(ge=0)] = Field(_RETRY.max_retries, description=_WHOLE)
    retry_backoff_seconds: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        _RETRY.backoff_seconds, description=_POSITIVE_SECONDS
    )
    retry_max_wait_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        _RETRY.max_wait_seconds, description=_SECONDS
    )
    cooldown_after_failures: Annotated[int, Field(ge=0), AfterValidator(_at_least_one_failure)] = (
        Field(_COOLDOWN.after_failures, description=_WHOLE)
    )
    cooldown_seconds: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        _COOLDOWN.base_seconds, description=_POSITIVE_SECONDS
    )
    cooldown_max_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        _COOLDOWN.max_seconds, description=_SECONDS
    )
    offline_demo: bool = Field(False, description=_TRUE_OR_FALSE)
    supports_reasoning_effort: bool = Field(False, description=_TRUE_OR_FALSE)
    tokens_per_minute: Annotated[int | None, Field(gt=0)] = Field(None, description=_POSITIVE_WHOLE)
    requests_per_minute: Annotated[int | None, Field(gt=0)] = Field(
        None, description=_POSITIVE_WHOLE
    )

    @model_validator(mode="before")
    @classmethod
    def _preset_fills_the_rest(cls, raw: object) -> object:
        """A preset supplies base_url, api_key_env and max_tokens_field; keys written
        next to it win."""
        if not isinstance(raw, dict) or not isinstance(raw.get("preset"), str):
            return raw
        preset = PRESETS.get(raw["preset"])
        if preset is None:
            return raw
        return {
            "base_url": preset.base_url,
            "api_key_env": preset.api_key_env,
            "max_tokens_field": preset.max_tokens_field,
            **raw,
        }

    def to_config(self) -> ProviderConfig:
        return ProviderConfig(
            name=self.name,
            base_url=self.base_url,
            api_key_env=self.api_key_env,
            models=dict(self.models),
            timeout_seconds=float(self.timeout_seconds),
            offline_demo=self.offline_demo,
            supports_reasoning_effort=self.supports_reasoning_effort,
            max_tokens_field=self.max_tokens_field,
            embedding_model=self.embedding_model or "",
            tokens_per_minute=self.tokens_per_minute,
            requests_per_minute=self.requests_per_minute,
            preset=self.preset,
            headers=dict(self.headers),
            retry=RetryPolicy(
                max_retries=self.max_retries,
                backoff_seconds=float(self.retry_backoff_seconds),
                max_wait_seconds=float(self.retry_max_wait_seconds),
            ),
            cooldown=CooldownPolicy(
                after_failures=self.cooldown_after_failures,
                base_seconds=float(self.cooldown_seconds),
                max_seconds=float(self.cooldown_max_seconds),
            ),
        )


class ProviderFile(BaseModel):
    """The whole file: one key, the providers in failover order."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    providers: list[ProviderEntry] = Field(min_length=1)


def parse_config(text: str, *, source: str) -> GatewayConfig:
    """Parse the YAML provider file; ConfigInvalid names the bad key and what is accepted."""
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except ConfigInvalid as exc:
        raise ConfigInvalid(f"{source}: {exc.message}") from exc
    except yaml.YAMLError as exc:
        raise ConfigInvalid(f"{source}: not valid YAML: {exc}") from exc
    try:
        parsed = ProviderFile.model_validate(document)
    except ValidationError as exc:
        # Not chained: pydantic's own text repeats the values, and one may be a key.
        raise _refused(exc, document, source=source) from None
    providers = tuple(entry.to_config() for entry in parsed.providers)
    names = [p.name for p in providers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigInvalid(f"{source}: provider names must be unique, {duplicates!r} repeat")
    return GatewayConfig(providers=providers, source=source)


def _refused(error: ValidationError, document: object, *, source: str) -> ConfigInvalid:
    """pydantic's errors as one ConfigInvalid in the file's words: the first mistake,
    with the path to the key and what the key accepts."""
    errors = error.errors()
    if not isinstance(document, dict) or any(e["loc"][:1] != ("providers",) for e in errors):
        return ConfigInvalid(
            f"{source}: the file must be a mapping with one key, 'providers' (a list), "
            f"got {_shown(document)}"
        )
    if any(e["loc"] == ("providers",) for e in errors):
        return ConfigInvalid(
            f"{source}: 'providers' must be a non-empty list, in failover order, "
            f"got {_shown(document.get('providers'))}"
        )
    index = min(int(e["loc"][1]) for e in errors)
    return _entry_refused(
        [e for e in errors if e["loc"][1] == index],
        document["providers"][index],
        where=f"{source}: providers[{index}]",
    )


def _entry_refused(errors: list[ErrorDetails], raw: object, *, where: str) -> ConfigInvalid:
    if not isinstance(raw, dict) or any(len(e["loc"]) == 2 for e in errors):
        return ConfigInvalid(f"{where} must be a mapping, got {_shown(raw)}")
    unknown = sorted(str(e["loc"][2]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        return ConfigInvalid(
            f"{where}: unknown key(s) {unknown!r}; accepted keys: "
            f"{', '.join(ProviderEntry.model_fields)}"
        )
    name = raw.get("name")
    if isinstance(name, str) and name.strip() and not _CONTROL.search(name):
        where = f"{where} ({name.strip()})"
    first = errors[0]
    path = first["loc"][2:]
    if path[-1:] == ("[key]",):
        path = path[:-2]
    if first["type"] == "cairn_config":
        return ConfigInvalid(f"{where}.{'.'.join(str(p) for p in path)}{first['msg']}")
    key = str(path[0])
    given = None if first["type"] == "missing" else first["input"]
    return ConfigInvalid(
        f"{where}.{key} {ProviderEntry.model_fields[key].description}, got {_shown(given)}"
    )


def check_base_url(value: object, *, where: str) -> str:
    """The URL as the gateway will use it (no trailing slash), or ConfigInvalid
    naming `where` and what is wrong with it."""
    try:
        return _base_url(value)
    except PydanticCustomError as exc:
        raise ConfigInvalid(f"{where}{exc.message()}") from None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
