"""Numbers a service reads from its environment: one rule for every positive
setting (a finite number above zero, or the default when unset), so a TTL of `nan`
or a timeout of `-1` stops start-up with one `service.config_invalid` line in every
service alike. Each service passes its own ConfigurationError subclass when its
error tree has one."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TypeVar

from cairn_libs.errors import ConfigurationError

Default = TypeVar("Default", float, int, None)


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(name, "").strip()


def positive_number(
    name: str,
    default: Default,
    *,
    unit: str = "number",
    env: Mapping[str, str] | None = None,
    error: type[ConfigurationError] = ConfigurationError,
) -> float | Default:
    """A finite number above 0 from `name` (`unit` names it in the refusal)."""
    raw = _raw(name, env)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise error(f"{name}={raw!r} is not a {unit}; give one above 0")
    return value


def positive_whole_number(
    name: str,
    default: Default,
    *,
    env: Mapping[str, str] | None = None,
    error: type[ConfigurationError] = ConfigurationError,
) -> int | Default:
    """A whole number above 0 from `name`."""
    raw = _raw(name, env)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise error(f"{name}={raw!r} is not a positive whole number")
    return value
