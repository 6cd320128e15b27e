"""What every request is checked for before a servicer sees it: the values a
protobuf message can carry but no cairn service can honour.

    U+0000 in a string             PostgreSQL text and jsonb cannot store it
    an enum number the schema      proto3 enums are open, so a caller can send
      does not define              any int32; code that names the value crashes
    a Timestamp outside            datetime and PostgreSQL cannot hold it
      0001-01-01..9999-12-31, or
      nanos outside 0..999999999
    a Duration outside ±10000      the range google.protobuf.Duration defines
      years, or with bad nanos
    NaN or ±Infinity in a double,  JSON, jsonb and every comparison break on it
      a float or a Struct number

One walk over the decoded message, driven by its descriptor alone (nested
messages, repeated fields, maps and their keys, Struct/Value/ListValue), so a
new field in a proto is covered without anyone remembering to. Checking in each
servicer instead was rejected: the sample defects of issue #10 were exactly the
fields someone forgot.

A refusal names the field path the way a caller wrote it (`messages[2].content`,
`metadata["k"][0]`) and says what would be accepted. Where one bad item must not
fail its siblings (a batch of documents), the bootstrap skips that field and the
service calls `violations` per item itself (see `cairn_libs.server`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from cairn_libs.errors import InvalidInput

# 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z, as google/protobuf/timestamp.proto defines.
TIMESTAMP_MIN_SECONDS = -62_135_596_800
TIMESTAMP_MAX_SECONDS = 253_402_300_799
# About 10000 years, as google/protobuf/duration.proto defines.
DURATION_MAX_SECONDS = 315_576_000_000
MAX_NANOS = 999_999_999

_TIMESTAMP = "google.protobuf.Timestamp"
_DURATION = "google.protobuf.Duration"
_STRUCT = "google.protobuf.Struct"
_VALUE = "google.protobuf.Value"
_LIST_VALUE = "google.protobuf.ListValue"

_WELL_KNOWN = frozenset({_TIMESTAMP, _DURATION, _STRUCT, _VALUE, _LIST_VALUE})
_FLOATING = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


@dataclass(frozen=True, slots=True)
class Violation:
    """One value the door refuses: where it is, and the sentence a caller reads."""

    path: str
    message: str


def violations(
    message: Message, *, path: str = "", skip: Collection[str] = ()
) -> Iterator[Violation]:
    """Every refused value in `message`, depth first in field-number order.

    `path` prefixes every reported path (e.g. `documents[3]` when a service checks
    one item of a batch); `skip` names top-level fields left to the service.
    """
    yield from _message(message, path, skip)


def first_violation(
    message: Message, *, path: str = "", skip: Collection[str] = ()
) -> Violation | None:
    return next(violations(message, path=path, skip=skip), None)


def check(message: Message, *, path: str = "", skip: Collection[str] = ()) -> None:
    """Raise InvalidInput naming the first refused value, if there is one."""
    found = first_violation(message, path=path, skip=skip)
    if found is not None:
        raise InvalidInput(found.message)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _message(message: Message, path: str, skip: Collection[str] = ()) -> Iterator[Violation]:
    descriptor: Any = message.DESCRIPTOR
    full_name = descriptor.full_name
    if not path and full_name in _WELL_KNOWN:
        path = "request"
    if full_name == _TIMESTAMP:
        yield from _timestamp(message, path)
        return
    if full_name == _DURATION:
        yield from _duration(message, path)
        return
    if full_name == _STRUCT:
        yield from _struct(message, path)
        return
    if full_name == _VALUE:
        yield from _value(message, path)
        return
    if full_name == _LIST_VALUE:
        yield from _list_value(message, path)
        return
    for field, value in message.ListFields():
        if field.name in skip:
            continue
        where = _join(path, field.name)
        if _is_map(field):
            yield from _map(field, value, where)
        elif field.is_repeated:
            for index, item in enumerate(value):
                yield from _single(field, item, f"{where}[{index}]")
        else:
            yield from _single(field, value, where)


def _is_map(field: FieldDescriptor) -> bool:
    entry: Any = field.message_type
    return (
        field.type == FieldDescriptor.TYPE_MESSAGE
        and field.is_repeated
        and bool(entry.GetOptions().map_entry)
    )


def _map(field: FieldDescriptor, entries: Any, where: str) -> Iterator[Violation]:
    entry: Any = field.message_type
    value_field = entry.fields_by_name["value"]
    for key in sorted(entries, key=repr):
        # Keys are strings, integers or bools: only a string can hold U+0000.
        if isinstance(key, str) and "\x00" in key:
            yield _nul_key(where)
            continue
        yield from _single(value_field, entries[key], f"{where}[{_key(key)}]")


def _key(key: object) -> str:
    return json.dumps(key, ensure_ascii=False) if isinstance(key, str) else repr(key)


def _single(field: FieldDescriptor, value: Any, where: str) -> Iterator[Violation]:
    kind = field.type
    if kind in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
        yield from _message(value, where)
    elif kind == FieldDescriptor.TYPE_STRING:
        if "\x00" in value:
            yield _nul(where)
    elif kind == FieldDescriptor.TYPE_ENUM:
        enum: Any = field.enum_type
        if value not in enum.values_by_number:
            names = ", ".join(v.name for v in enum.values)
            yield Violation(
                where,
                f"{where} is {value!r}, which is not a {enum.name}; use one of {names}",
            )
    elif kind in _FLOATING and not math.isfinite(value):
        yield _not_finite(where, value)


def _nul(where: str) -> Violation:
    return Violation(where, f"{where} contains U+0000, which cannot be stored; remove it")


def _nul_key(where: str) -> Violation:
    return Violation(where, f"a key of {where} contains U+0000, which cannot be stored; remove it")


def _not_finite(where: str, value: float) -> Violation:
    return Violation(where, f"{where} is {value!r}; send a finite number (no NaN or Infinity)")


def _timestamp(message: Any, where: str) -> Iterator[Violation]:
    seconds, nanos = int(message.seconds), int(message.nanos)
    if not TIMESTAMP_MIN_SECONDS <= seconds <= TIMESTAMP_MAX_SECONDS:
        yield Violation(
            where,
            f"{where} has seconds={seconds!r}, outside 0001-01-01T00:00:00Z..9999-12-31T23:59:59Z; "
            "send a time in that range",
        )
    elif not 0 <= nanos <= MAX_NANOS:
        yield Violation(where, f"{where} has nanos={nanos!r}; send nanos from 0 to {MAX_NANOS}")


def _duration(message: Any, where: str) -> Iterator[Violation]:
    seconds, nanos = int(message.seconds), int(message.nanos)
    if not -DURATION_MAX_SECONDS <= seconds <= DURATION_MAX_SECONDS:
        yield Violation(
            where,
            f"{where} has seconds={seconds!r}; a duration is at most "
            f"{DURATION_MAX_SECONDS} seconds either way",
        )
    elif not -MAX_NANOS <= nanos <= MAX_NANOS or (seconds * nanos < 0):
        yield Violation(
            where,
            f"{where} has nanos={nanos!r}; send nanos from -{MAX_NANOS} to {MAX_NANOS} "
            "with the sign of seconds",
        )


def _struct(message: Any, where: str) -> Iterator[Violation]:
    for key in sorted(message.fields):
        if "\x00" in key:
            yield _nul_key(where)
            continue
        yield from _value(message.fields[key], f"{where}[{_key(key)}]")


def _list_value(message: Any, where: str) -> Iterator[Violation]:
    for index, item in enumerate(message.values):
        yield from _value(item, f"{where}[{index}]")


def _value(message: Any, where: str) -> Iterator[Violation]:
    kind = message.WhichOneof("kind")
    if kind == "number_value":
        if not math.isfinite(message.number_value):
            yield _not_finite(where, message.number_value)
    elif kind == "string_value":
        if "\x00" in message.string_value:
            yield _nul(where)
    elif kind == "struct_value":
        yield from _struct(message.struct_value, where)
    elif kind == "list_value":
        yield from _list_value(message.list_value, where)
