"""How remembered notes reach a model: one fenced data block (I8) in which every
line says where the memory came from and what kind of claim it is, ending with
the sentence that a memory is never on its own a reason to accept or reject
anybody (I9; the sentence is pinned by a test).

The memory text is quoted as a JSON string on a line of its own making, after
its origin, so no text inside a memory can end its quote, start a new line, pose
as another memory's origin, or close the fence (the fence's nonce is drawn
fresh and never occurs in the content).

It renders plain values (RenderableMemory: what a line reads, and nothing else),
not memory protos: a caller keeps its own domain record, which satisfies the
Protocol as it is, and no proto is rebuilt inside a pure path to be rendered.
Kinds, claim types and states are the proto enum names without their prefix
("CANDIDATE", "INFERENCE", "ACTIVE"); "" or a name it does not know reads as
unknown, as the proto's UNSPECIFIED did.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Final, Protocol

from cairn_libs.fence import fence

NEVER_A_REASON: Final = "A memory is never on its own a reason to accept or reject anybody."
NO_MEMORIES: Final = "No memories are held for this."

_CLAIMS: Final = {
    "USER_STATEMENT": "a user's statement",
    "INFERENCE": "an inference",
}
_SUBJECTS: Final = {
    "WORKSPACE": "the workspace",
    "USER": "user",
    "CANDIDATE": "candidate",
    "EMPLOYEE": "employee",
    "CUSTOMER": "customer",
}
# Every state but ACTIVE that a memory can be in; an unset state ("") is shown.
_NOT_RECALLABLE: Final = frozenset({"SUPERSEDED", "EXPIRED", "ERASED"})


class RenderableMemory(Protocol):
    """What a memory line reads. Times are timezone-aware (a naive one is taken as UTC);
    None means not known (created_at, expires_at) or not bounded (valid_*)."""

    @property
    def text(self) -> str: ...
    @property
    def subject_kind(self) -> str: ...
    @property
    def subject_id(self) -> str: ...
    @property
    def author_kind(self) -> str: ...
    @property
    def author_id(self) -> str: ...
    @property
    def run_id(self) -> str: ...
    @property
    def claim_type(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def created_at(self) -> datetime | None: ...
    @property
    def expires_at(self) -> datetime | None: ...
    @property
    def valid_from(self) -> datetime | None: ...
    @property
    def valid_until(self) -> datetime | None: ...


def render_memories(memories: Sequence[RenderableMemory], *, now: datetime) -> str:
    """The fenced block a model reads; memories not recallable at `now` (not active,
    expired, outside their validity window, or without readable text) are left out."""
    lines = [memory_line(m) for m in memories if _shown(m, now=now)]
    body = "\n".join([*(lines or [NO_MEMORIES]), "", NEVER_A_REASON])
    return fence("memory", body).text


def memory_line(memory: RenderableMemory) -> str:
    return (
        f"- {_origin(memory)}; about {_subject(memory)}; {_claim(memory)}: {_quoted(memory.text)}"
    )


def _origin(memory: RenderableMemory) -> str:
    day = _day(memory.created_at) if memory.created_at is not None else "an unknown date"
    if memory.author_kind == "MODEL":
        return f"written by an agent in run {_token(memory.run_id)} on {day}"
    if memory.author_kind == "PERSON":
        return f"noted by {_token(memory.author_id)} on {day}"
    return f"of unknown origin, kept on {day}"


def _subject(memory: RenderableMemory) -> str:
    kind = _SUBJECTS.get(memory.subject_kind, "an unknown subject")
    if memory.subject_kind == "WORKSPACE" or not memory.subject_id:
        return kind
    return f"{kind} {_token(memory.subject_id)}"


def _claim(memory: RenderableMemory) -> str:
    return f"claim type: {_CLAIMS.get(memory.claim_type, 'unknown')}"


def _utc(moment: datetime) -> datetime:
    # A naive time is UTC, as google.protobuf.Timestamp took it when this read protos.
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _day(moment: datetime) -> str:
    return _utc(moment).strftime("%Y-%m-%d")


def _token(value: str) -> str:
    """An identifier as one printable word (ids come from tokens, but are still data)."""
    cleaned = "".join(ch if ch.isprintable() and not ch.isspace() else "_" for ch in value)
    return json.dumps(cleaned, ensure_ascii=False) if not cleaned or '"' in cleaned else cleaned


def _quoted(text: str) -> str:
    # str.split() also splits on the Unicode line and paragraph separators, so the
    # memory is one line; json escapes its quotes, backslashes and control characters.
    return json.dumps(" ".join(text.split()), ensure_ascii=False)


def _shown(memory: RenderableMemory, *, now: datetime) -> bool:
    if memory.state in _NOT_RECALLABLE:
        return False
    if not memory.text.strip():
        return False
    if memory.expires_at is not None and _utc(memory.expires_at) <= now:
        return False
    if memory.valid_from is not None and _utc(memory.valid_from) > now:
        return False
    return not (memory.valid_until is not None and _utc(memory.valid_until) <= now)
