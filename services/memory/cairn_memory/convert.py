"""Memory protos to domain values and back: the door's conversions, in one place.

The servicer calls these and nothing past it sees a proto (the way temporalio's
converters sit between its wire and its types). Enum values the proto does not
define are refused here, as part of conversion; every other rule lives in the
domain.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2

from cairn.memory.v1 import memory_pb2
from cairn_memory.domain import (
    Author,
    AuthorKind,
    Block,
    ClaimType,
    Erasure,
    FactVersion,
    Memory,
    MemoryState,
    ProfileFact,
    RecallMode,
    RememberDraft,
    Subject,
    SubjectKind,
    subject_from,
)
from cairn_memory.errors import RefusedInput

_SUBJECT_KINDS: Mapping[memory_pb2.SubjectKind.ValueType, SubjectKind] = {
    memory_pb2.SUBJECT_KIND_WORKSPACE: SubjectKind.WORKSPACE,
    memory_pb2.SUBJECT_KIND_USER: SubjectKind.USER,
    memory_pb2.SUBJECT_KIND_CANDIDATE: SubjectKind.CANDIDATE,
    memory_pb2.SUBJECT_KIND_EMPLOYEE: SubjectKind.EMPLOYEE,
    memory_pb2.SUBJECT_KIND_CUSTOMER: SubjectKind.CUSTOMER,
}
_CLAIM_TYPES: Mapping[memory_pb2.ClaimType.ValueType, ClaimType] = {
    memory_pb2.CLAIM_TYPE_UNKNOWN: ClaimType.UNKNOWN,
    memory_pb2.CLAIM_TYPE_USER_STATEMENT: ClaimType.USER_STATEMENT,
    memory_pb2.CLAIM_TYPE_INFERENCE: ClaimType.INFERENCE,
}
_AUTHOR_KINDS = {
    AuthorKind.MODEL: memory_pb2.AUTHOR_KIND_MODEL,
    AuthorKind.PERSON: memory_pb2.AUTHOR_KIND_PERSON,
}
_STATES = {
    MemoryState.ACTIVE: memory_pb2.MEMORY_STATE_ACTIVE,
    MemoryState.SUPERSEDED: memory_pb2.MEMORY_STATE_SUPERSEDED,
    MemoryState.EXPIRED: memory_pb2.MEMORY_STATE_EXPIRED,
    MemoryState.ERASED: memory_pb2.MEMORY_STATE_ERASED,
}
_RECALL_MODES = {
    RecallMode.SEMANTIC: memory_pb2.RECALL_MODE_SEMANTIC,
    RecallMode.NEWEST_FIRST: memory_pb2.RECALL_MODE_NEWEST_FIRST,
}
_SUBJECT_KINDS_TO_PROTO = {kind: number for number, kind in _SUBJECT_KINDS.items()}
_CLAIM_TYPES_TO_PROTO = {claim: number for number, claim in _CLAIM_TYPES.items()}

_E = TypeVar("_E")
_K = TypeVar("_K", bound=int)


# --- from proto -------------------------------------------------------------------


def _enum_from_proto(
    value: int, table: Mapping[_K, _E], *, field_name: str, accepted: str
) -> _E | None:
    if value == 0:
        return None
    for number, member in table.items():
        if number == value:
            return member
    raise RefusedInput(f"{field_name} {value!r} is not known; use one of {accepted}")


def _subject_kind_from_proto(value: int, *, field_name: str) -> SubjectKind | None:
    return _enum_from_proto(
        value,
        _SUBJECT_KINDS,
        field_name=f"{field_name}.kind",
        accepted=", ".join(memory_pb2.SubjectKind.Name(n) for n in _SUBJECT_KINDS),
    )


def subject_from_proto(message: memory_pb2.Subject, *, field_name: str = "subject") -> Subject:
    return subject_from(
        _subject_kind_from_proto(message.kind, field_name=field_name),
        message.id,
        field_name=field_name,
    )


def optional_subject_from_proto(
    request: memory_pb2.RecallRequest,
) -> Subject | None:
    if not request.HasField("subject") or (
        request.subject.kind == memory_pb2.SUBJECT_KIND_UNSPECIFIED and not request.subject.id
    ):
        return None
    return subject_from_proto(request.subject)


def _time_from_proto(message: Any, field_name: str) -> datetime | None:
    if not message.HasField(field_name):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(message, field_name)
    try:
        return stamp.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise RefusedInput(
            f"{field_name} (seconds={stamp.seconds}, nanos={stamp.nanos}) is out of range; "
            "give a time between 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z with nanos "
            "0-999999999"
        ) from None


def remember_draft_from_proto(request: memory_pb2.RememberRequest) -> RememberDraft:
    return RememberDraft(
        text=request.text,
        subject_kind=_subject_kind_from_proto(request.subject.kind, field_name="subject"),
        subject_id=request.subject.id,
        tags=tuple(request.tags),
        importance=request.importance,
        claim_type=_enum_from_proto(
            request.claim_type,
            _CLAIM_TYPES,
            field_name="claim_type",
            accepted=", ".join(memory_pb2.ClaimType.Name(n) for n in _CLAIM_TYPES),
        ),
        event_at=_time_from_proto(request, "event_at"),
        valid_from=_time_from_proto(request, "valid_from"),
        valid_until=_time_from_proto(request, "valid_until"),
        source_ref=request.source_ref,
        supersedes=tuple(request.supersedes),
    )


# --- to proto ---------------------------------------------------------------------


def _timestamp(moment: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def subject_to_proto(subject: Subject) -> memory_pb2.Subject:
    return memory_pb2.Subject(kind=_SUBJECT_KINDS_TO_PROTO[subject.kind], id=subject.id)


def _provenance(
    author: Author,
    *,
    created_at: datetime,
    expires_at: datetime,
    superseded_by: str = "",
    source_ref: str = "",
) -> memory_pb2.Provenance:
    return memory_pb2.Provenance(
        author_kind=_AUTHOR_KINDS[author.kind],
        author_id=author.id,
        run_id=author.run_id,
        on_behalf_of=author.on_behalf_of,
        created_at=_timestamp(created_at),
        expires_at=_timestamp(expires_at),
        superseded_by=superseded_by,
        declared_source_ref=source_ref,
    )


def memory_to_proto(memory: Memory) -> memory_pb2.Memory:
    message = memory_pb2.Memory(
        memory_id=memory.memory_id,
        subject=subject_to_proto(memory.subject),
        text=memory.text,
        tags=list(memory.tags),
        importance=memory.importance,
        claim_type=_CLAIM_TYPES_TO_PROTO[memory.claim_type],
        provenance=_provenance(
            memory.author,
            created_at=memory.created_at,
            expires_at=memory.expires_at,
            superseded_by=memory.superseded_by,
            source_ref=memory.source_ref,
        ),
        state=_STATES[memory.state],
        score=memory.score,
        readable=memory.readable,
    )
    for name, moment in (
        ("event_at", memory.event_at),
        ("valid_from", memory.valid_from),
        ("valid_until", memory.valid_until),
    ):
        if moment is not None:
            getattr(message, name).CopyFrom(_timestamp(moment))
    return message


def _version_to_proto(version: FactVersion) -> memory_pb2.ProfileFactVersion:
    return memory_pb2.ProfileFactVersion(
        value=version.value,
        provenance=_provenance(
            version.author, created_at=version.created_at, expires_at=version.expires_at
        ),
        readable=version.readable,
    )


def fact_to_proto(fact: ProfileFact) -> memory_pb2.ProfileFact:
    message = memory_pb2.ProfileFact(
        subject=subject_to_proto(fact.subject),
        fact_key=fact.fact_key,
        history=[_version_to_proto(v) for v in fact.history],
    )
    if fact.current is not None:
        message.value = fact.current.value
        message.readable = fact.current.readable
        message.provenance.CopyFrom(_version_to_proto(fact.current).provenance)
    return message


def erasure_to_proto(erasure: Erasure) -> memory_pb2.Erasure:
    return memory_pb2.Erasure(
        subject=subject_to_proto(erasure.subject),
        erased_by=erasure.erased_by,
        erased_at=_timestamp(erasure.erased_at),
        memories_erased=erasure.memories_erased,
        facts_erased=erasure.facts_erased,
        blocks_erased=erasure.blocks_erased,
        copies_erased=erasure.copies_erased,
    )


def recall_mode_to_proto(mode: RecallMode) -> memory_pb2.RecallMode.ValueType:
    return _RECALL_MODES[mode]


def block_to_proto(block: Block) -> memory_pb2.Block:
    return memory_pb2.Block(
        block_id=block.block_id,
        label=block.label,
        role=block.role,
        content=block.content,
        conversation_id=block.conversation_id,
        created_at=_timestamp(block.created_at),
        readable=block.readable,
        subjects=[subject_to_proto(about) for about in block.subjects],
        erased=block.erased,
    )
