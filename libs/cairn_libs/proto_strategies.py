"""Hypothesis strategies for any protobuf message, built from its descriptor alone,
so a fuzz or a property test covers a field the day it is added to a proto.

Test support, like `pytest_plugin`: services never import it (hypothesis is a
development dependency).

`hostile=True` draws what a caller can put on the wire but no service should
honour: U+0000 and odd unicode in strings, enum numbers the schema does not
define, the extremes of every integer width, NaN and infinities, Timestamps and
Durations out of range. `hostile=False` draws only values the door
(`cairn_libs.door`) accepts, so a property can state "valid in, no refusal out".
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from cairn_libs.door import (
    DURATION_MAX_SECONDS,
    MAX_NANOS,
    TIMESTAMP_MAX_SECONDS,
    TIMESTAMP_MIN_SECONDS,
)

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}

# Strings a caller can send: protobuf strings are UTF-8, so no lone surrogates.
_ODD = ["\x00", "a\x00b", "\u202e", "\ufeff", "\U0001f600", "\u0301", "\uffff", "\r\n", "'\"", "%s"]
# Values a service parses out of a string (page tokens, times, ids).
_PARSED = [
    "2024-01-01T00:00:00",
    "2024-01-01T00:00:00+00:00",
    "0001-01-01T00:00:00+14:00",
    "9999-12-31T23:59:59-14:00",
    "00000000-0000-0000-0000-000000000000",
    "-1",
    "1e400",
    "NaN",
    "null",
]


def _plain_text(*, nul: bool) -> st.SearchStrategy[str]:
    excluded = "" if nul else "\x00"
    return st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters=excluded), max_size=40
    )


def crafted_tokens() -> st.SearchStrategy[str]:
    """Page tokens and cursors a caller made up: base64url (padding stripped, as
    cairn's own tokens are) of JSON objects or `|`-joined fields holding hostile
    values, so a service's token parser is reached past its base64 step."""
    parts = st.one_of(st.sampled_from(_PARSED + _ODD), _plain_text(nul=True))
    json_values = st.one_of(
        parts, st.integers(), st.floats(), st.none(), st.lists(parts, max_size=2)
    )
    payloads = st.one_of(
        st.dictionaries(
            st.sampled_from(["c", "r", "t", "id", "after", "offset", "scope"]),
            json_values,
            max_size=4,
        ).map(lambda d: json.dumps(d, allow_nan=True)),
        st.lists(parts, min_size=1, max_size=4).map("|".join),
    )
    return payloads.map(lambda p: base64.urlsafe_b64encode(p.encode()).decode().rstrip("="))


def _text(*, hostile: bool, seeds: Sequence[str] = ()) -> st.SearchStrategy[str]:
    options = [_plain_text(nul=hostile)]
    if seeds:
        options.append(st.sampled_from(list(seeds)))
    if hostile:
        options += [
            st.sampled_from(_ODD + _PARSED),
            st.lists(st.sampled_from(_ODD)).map("".join),
            crafted_tokens(),
        ]
    return st.one_of(*options)


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([low, high, 0, -1 if low < 0 else 1]), st.integers(low, high))


def _floats(*, hostile: bool, width: int) -> st.SearchStrategy[float]:
    return st.floats(allow_nan=hostile, allow_infinity=hostile, width=width)  # type: ignore[arg-type]


def _json_value(*, hostile: bool) -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.none(), st.booleans(), _floats(hostile=hostile, width=64), _text(hostile=hostile)
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(_text(hostile=hostile), inner, max_size=4)
        ),
        max_leaves=12,
    )


def _well_known(descriptor: Descriptor, *, hostile: bool) -> st.SearchStrategy[Message] | None:
    cls = message_factory.GetMessageClass(descriptor)
    name = descriptor.full_name
    if name == "google.protobuf.Timestamp":
        seconds = (
            _integers(-(2**63), 2**63 - 1)
            if hostile
            else st.integers(TIMESTAMP_MIN_SECONDS, TIMESTAMP_MAX_SECONDS)
        )
        nanos = _integers(-(2**31), 2**31 - 1) if hostile else st.integers(0, MAX_NANOS)
        return st.builds(cls, seconds=seconds, nanos=nanos)
    if name == "google.protobuf.Duration":
        if hostile:
            return st.builds(
                cls, seconds=_integers(-(2**63), 2**63 - 1), nanos=_integers(-(2**31), 2**31 - 1)
            )
        return st.builds(
            cls, seconds=st.integers(0, DURATION_MAX_SECONDS), nanos=st.integers(0, MAX_NANOS)
        )
    if name == "google.protobuf.Struct":
        return st.dictionaries(
            _text(hostile=hostile), _json_value(hostile=hostile), max_size=4
        ).map(lambda d: _struct(cls, d))
    if name == "google.protobuf.Value":
        return _json_value(hostile=hostile).map(lambda v: _value(cls, v))
    if name == "google.protobuf.ListValue":
        return st.lists(_json_value(hostile=hostile), max_size=4).map(lambda v: _list(cls, v))
    return None


def _struct(cls: Any, value: dict[str, Any]) -> Message:
    message: Any = cls()
    message.update(value)
    return message  # type: ignore[no-any-return]


def _value(cls: Any, value: Any) -> Message:
    holder: Any = message_factory.GetMessageClass(
        cls.DESCRIPTOR.file.message_types_by_name["Struct"]
    )()
    holder.update({"v": value})
    message = cls()
    message.CopyFrom(holder.fields["v"])
    return message  # type: ignore[no-any-return]


def _list(cls: Any, values: list[Any]) -> Message:
    message = cls()
    message.extend(values)
    return message  # type: ignore[no-any-return]


def _scalar(
    field: FieldDescriptor, *, hostile: bool, seeds: Sequence[str] = ()
) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return _integers(low, high) if hostile else st.integers(max(low, -1000), min(high, 1000))
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return _floats(hostile=hostile, width=64)
    if kind == FieldDescriptor.TYPE_FLOAT:
        return _floats(hostile=hostile, width=32)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return _text(hostile=hostile, seeds=seeds)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if kind == FieldDescriptor.TYPE_ENUM:
        enum: Any = field.enum_type
        defined = st.sampled_from([v.number for v in enum.values])
        return st.one_of(defined, _integers(-(2**31), 2**31 - 1)) if hostile else defined
    raise TypeError(f"no strategy for field {field.full_name!r} of type {kind!r}")


def messages(
    descriptor: Descriptor,
    *,
    hostile: bool = True,
    max_depth: int = 4,
    seeds: Sequence[str] = (),
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type; nesting beyond `max_depth` stays unset.
    `seeds` are strings drawn now and then for any string field (names a
    deployment knows, such as its agents), so a fuzz reaches past "unknown"."""
    special = _well_known(descriptor, hostile=hostile)
    if special is not None:
        return special
    cls = message_factory.GetMessageClass(descriptor)

    @st.composite  # type: ignore[untyped-decorator]
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        chosen_oneofs: set[str] = set()
        for field in descriptor.fields:
            oneof = field.containing_oneof
            if oneof is not None and oneof.name in chosen_oneofs:
                continue
            if not draw(st.booleans()):
                continue
            if oneof is not None:
                chosen_oneofs.add(oneof.name)
            _fill(draw, message, field, hostile=hostile, depth=max_depth, seeds=seeds)
        return message

    return build()


def _fill(
    draw: st.DrawFn,
    message: Message,
    field: FieldDescriptor,
    *,
    hostile: bool,
    depth: int,
    seeds: Sequence[str],
) -> None:
    is_message = field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP)
    if is_message and depth <= 0:
        return
    target = getattr(message, field.name)
    message_type: Any = field.message_type
    if is_message and field.is_repeated and message_type.GetOptions().map_entry:
        key_field = message_type.fields_by_name["key"]
        value_field = message_type.fields_by_name["value"]
        keys = draw(
            st.lists(_scalar(key_field, hostile=hostile, seeds=seeds), max_size=3, unique=True)
        )
        for key in keys:
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                target[key].CopyFrom(
                    draw(
                        messages(
                            value_field.message_type,
                            hostile=hostile,
                            max_depth=depth - 1,
                            seeds=seeds,
                        )
                    )
                )
            else:
                target[key] = draw(_scalar(value_field, hostile=hostile, seeds=seeds))
        return
    if is_message:
        inner = messages(message_type, hostile=hostile, max_depth=depth - 1, seeds=seeds)
        if field.is_repeated:
            for item in draw(st.lists(inner, max_size=3)):
                target.add().CopyFrom(item)
        else:
            target.CopyFrom(draw(inner))
        return
    if field.is_repeated:
        target.extend(draw(st.lists(_scalar(field, hostile=hostile, seeds=seeds), max_size=4)))
        return
    setattr(message, field.name, draw(_scalar(field, hostile=hostile, seeds=seeds)))
