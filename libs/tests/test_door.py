"""The door's walk over any message: what it refuses, where it says it found it, and
that it refuses nothing a caller may legitimately send."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cairn.gateway.v1 import gateway_pb2
from cairn.memory.v1 import memory_pb2
from cairn.orchestrator.v1 import orchestrator_pb2
from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs import door
from cairn_libs.errors import InvalidInput
from cairn_libs.proto_strategies import messages

EVERY_MESSAGE = [
    descriptor
    for module in (gateway_pb2, retrieval_pb2, memory_pb2, orchestrator_pb2)
    for descriptor in module.DESCRIPTOR.message_types_by_name.values()
]
QUICK = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("descriptor", EVERY_MESSAGE, ids=lambda d: d.full_name)
def test_nothing_a_caller_may_legitimately_send_is_refused(descriptor: Descriptor) -> None:
    @QUICK
    @given(messages(descriptor, hostile=False))
    def holds(message: Message) -> None:
        assert door.first_violation(message) is None

    holds()


@dataclass(frozen=True)
class Slot:
    """A place in a drawn message where one bad value can be put."""

    path: str
    kind: int
    put: Callable[[Any], None]


def _slots(message: Message, path: str = "") -> Iterator[Slot]:
    descriptor: Any = message.DESCRIPTOR
    if descriptor.full_name.startswith("google.protobuf."):
        return
    for field in descriptor.fields:
        where = f"{path}.{field.name}" if path else field.name
        target = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if (
                field.message_type.full_name == "google.protobuf.Timestamp"
                and not field.is_repeated
            ):
                yield Slot(
                    where, field.type, lambda v, m=message, f=field: getattr(m, f.name).CopyFrom(v)
                )
            elif field.is_repeated:
                for index, item in enumerate(target):
                    yield from _slots(item, f"{where}[{index}]")
            elif message.HasField(field.name):
                yield from _slots(target, where)
        elif field.type in (
            FieldDescriptor.TYPE_STRING,
            FieldDescriptor.TYPE_ENUM,
            FieldDescriptor.TYPE_DOUBLE,
            FieldDescriptor.TYPE_FLOAT,
        ):
            if field.is_repeated:
                for index in range(len(target)):
                    yield Slot(
                        f"{where}[{index}]",
                        field.type,
                        lambda v, t=target, i=index: t.__setitem__(i, v),
                    )
            elif field.containing_oneof is None or message.WhichOneof(
                field.containing_oneof.name
            ) in (None, field.name):
                yield Slot(where, field.type, lambda v, m=message, f=field: setattr(m, f.name, v))


def _bad_value(slot: Slot) -> Any:
    from google.protobuf import timestamp_pb2

    return {
        FieldDescriptor.TYPE_STRING: "left\x00right",
        FieldDescriptor.TYPE_ENUM: 2**31 - 1,
        FieldDescriptor.TYPE_DOUBLE: math.nan,
        FieldDescriptor.TYPE_FLOAT: -math.inf,
        FieldDescriptor.TYPE_MESSAGE: timestamp_pb2.Timestamp(
            seconds=door.TIMESTAMP_MAX_SECONDS + 1
        ),
    }[slot.kind]


@pytest.mark.parametrize("descriptor", EVERY_MESSAGE, ids=lambda d: d.full_name)
def test_one_bad_value_anywhere_is_refused_at_the_path_it_was_put(descriptor: Descriptor) -> None:
    @QUICK
    @given(messages(descriptor, hostile=False), st.data())
    def holds(message: Message, data: st.DataObject) -> None:
        slots = list(_slots(message))
        if not slots:
            return
        slot = data.draw(st.sampled_from(slots))
        slot.put(_bad_value(slot))

        found = door.first_violation(message)

        assert found is not None
        assert found.path == slot.path
        assert found.message.startswith(slot.path)

    holds()


def test_a_nul_in_a_later_message_of_a_list_names_its_index() -> None:
    request = gateway_pb2.ChatRequest(
        messages=[
            gateway_pb2.Message(content="a"),
            gateway_pb2.Message(content="b"),
            gateway_pb2.Message(content="\x00"),
        ]
    )

    with pytest.raises(InvalidInput) as refused:
        door.check(request)

    assert refused.value.message == (
        "messages[2].content contains U+0000, which cannot be stored; remove it"
    )


def test_struct_numbers_strings_and_keys_are_checked_at_any_depth() -> None:
    document = retrieval_pb2.Document(document_id="d")
    document.metadata.update(
        {"ok": 1, "deep": [1, {"score": math.nan}], "k\x00": "v", "s": "x\x00"}
    )

    found = [v.message for v in door.violations(document, path="documents[4]")]

    assert found == [
        'documents[4].metadata["deep"][1]["score"] is nan; send a finite number (no NaN or Infinity)',
        "a key of documents[4].metadata contains U+0000, which cannot be stored; remove it",
        'documents[4].metadata["s"] contains U+0000, which cannot be stored; remove it',
    ]


@pytest.mark.parametrize(
    ("seconds", "nanos", "refused"),
    [
        (door.TIMESTAMP_MIN_SECONDS, 0, False),
        (door.TIMESTAMP_MAX_SECONDS, door.MAX_NANOS, False),
        (door.TIMESTAMP_MIN_SECONDS - 1, 0, True),
        (door.TIMESTAMP_MAX_SECONDS + 1, 0, True),
        (0, -1, True),
        (0, door.MAX_NANOS + 1, True),
    ],
)
def test_a_timestamp_is_accepted_exactly_within_year_1_to_9999(
    seconds: int, nanos: int, refused: bool
) -> None:
    request = memory_pb2.RememberRequest(text="t")
    request.event_at.seconds, request.event_at.nanos = seconds, nanos

    found = door.first_violation(request)

    assert (found is not None) == refused
    if found is not None:
        assert found.path == "event_at"


def test_a_duration_with_nanos_against_the_sign_of_its_seconds_is_refused() -> None:
    attempt = gateway_pb2.Attempt()
    attempt.latency.seconds, attempt.latency.nanos = 1, -5

    found = door.first_violation(attempt)

    assert found is not None and found.path == "latency"


def test_skipped_fields_are_left_to_the_service() -> None:
    request = retrieval_pb2.IngestDocumentsRequest(documents=[retrieval_pb2.Document(text="\x00")])

    assert door.first_violation(request, skip={"documents"}) is None
    assert door.first_violation(request) is not None


def _message_with_maps() -> type[Message]:
    """A message with map fields, which no cairn proto has yet."""
    file = descriptor_pb2.FileDescriptorProto(
        name="door_maps.proto", package="doortest", syntax="proto3"
    )
    inner = file.message_type.add(name="Inner")
    inner.field.add(name="note", number=1, type=FieldDescriptor.TYPE_STRING, label=1)
    holder = file.message_type.add(name="Holder")
    for name, number, value_type, type_name in (
        ("labels", 1, FieldDescriptor.TYPE_STRING, ""),
        ("inners", 2, FieldDescriptor.TYPE_MESSAGE, ".doortest.Inner"),
    ):
        entry = holder.nested_type.add(name=f"{name.capitalize()}Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=FieldDescriptor.TYPE_STRING, label=1)
        value = entry.field.add(name="value", number=2, type=value_type, label=1)
        if type_name:
            value.type_name = type_name
        holder.field.add(
            name=name,
            number=number,
            type=FieldDescriptor.TYPE_MESSAGE,
            label=3,
            type_name=f".doortest.Holder.{entry.name}",
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("doortest.Holder"))


def test_map_keys_and_values_are_checked_and_named() -> None:
    holder: Any = _message_with_maps()()
    holder.labels["fine"] = "ok"
    holder.labels["bad\x00key"] = "ok"
    holder.inners["x"].note = "n\x00"

    found = [v.message for v in door.violations(holder)]

    assert found == [
        "a key of labels contains U+0000, which cannot be stored; remove it",
        'inners["x"].note contains U+0000, which cannot be stored; remove it',
    ]


def test_a_top_level_struct_is_named_request() -> None:
    value = struct_pb2.Struct()
    value.update({"n": math.inf})

    found = door.first_violation(value)

    assert found is not None and found.path == 'request["n"]'
