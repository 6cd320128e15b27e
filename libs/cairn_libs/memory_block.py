"""How remembered notes reach a model: one fenced data block (I8) in which every
line says where the memory came from and what kind of claim it is, ending with
the sentence that a memory is never on its own a reason to accept or reject
anybody (I9; the sentence is pinned by a test).

The memory text is quoted as a JSON string on a line of its own making, after
its origin, so no text inside a memory can end its quote, start a new line, pose
as another memory's origin, or close the fence (the fence's nonce is drawn
fresh and never occurs in the content).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Final

from cairn.memory.v1 import memory_pb2
from cairn_libs.fence import fence

NEVER_A_REASON: Final = "A memory is never on its own a reason to accept or reject anybody."
NO_MEMORIES: Final = "No memories are held for this."

_CLAIMS: Final = {
    memory_pb2.CLAIM_TYPE_USER_STATEMENT: "a user's statement",
    memory_pb2.CLAIM_TYPE_INFERENCE: "an inference",
}
_SUBJECTS: Final = {
    memory_pb2.SUBJECT_KIND_WORKSPACE: "the workspace",
    memory_pb2.SUBJECT_KIND_USER: "user",
    memory_pb2.SUBJECT_KIND_CANDIDATE: "candidate",
    memory_pb2.SUBJECT_KIND_EMPLOYEE: "employee",
    memory_pb2.SUBJECT_KIND_CUSTOMER: "customer",
}


def render_memories(memories: Sequence[memory_pb2.Memory], *, now: datetime) -> str:
    """The fenced block a model reads; memories not recallable at `now` (not active,
    expired, outside their validity window, or without readable text) are left out."""
    lines = [memory_line(m) for m in memories if _shown(m, now=now)]
    body = "\n".join([*(lines or [NO_MEMORIES]), "", NEVER_A_REASON])
    return fence("memory", body).text


def memory_line(memory: memory_pb2.Memory) -> str:
    return (
        f"- {_origin(memory)}; about {_subject(memory)}; {_claim(memory)}: {_quoted(memory.text)}"
    )


def _origin(memory: memory_pb2.Memory) -> str:
    provenance = memory.provenance
    day = (
        _day(provenance.created_at.ToDatetime(tzinfo=UTC))
        if provenance.HasField("created_at")
        else "an unknown date"
    )
    if provenance.author_kind == memory_pb2.AUTHOR_KIND_MODEL:
        return f"written by an agent in run {_token(provenance.run_id)} on {day}"
    if provenance.author_kind == memory_pb2.AUTHOR_KIND_PERSON:
        return f"noted by {_token(provenance.author_id)} on {day}"
    return f"of unknown origin, kept on {day}"


def _subject(memory: memory_pb2.Memory) -> str:
    kind = _SUBJECTS.get(memory.subject.kind, "an unknown subject")
    if memory.subject.kind == memory_pb2.SUBJECT_KIND_WORKSPACE or not memory.subject.id:
        return kind
    return f"{kind} {_token(memory.subject.id)}"


def _claim(memory: memory_pb2.Memory) -> str:
    return f"claim type: {_CLAIMS.get(memory.claim_type, 'unknown')}"


def _day(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d")


def _token(value: str) -> str:
    """An identifier as one printable word (ids come from tokens, but are still data)."""
    cleaned = "".join(ch if ch.isprintable() and not ch.isspace() else "_" for ch in value)
    return json.dumps(cleaned, ensure_ascii=False) if not cleaned or '"' in cleaned else cleaned


def _quoted(text: str) -> str:
    # str.split() also splits on the Unicode line and paragraph separators, so the
    # memory is one line; json escapes its quotes, backslashes and control characters.
    return json.dumps(" ".join(text.split()), ensure_ascii=False)


def _shown(memory: memory_pb2.Memory, *, now: datetime) -> bool:
    if memory.state not in (memory_pb2.MEMORY_STATE_ACTIVE, memory_pb2.MEMORY_STATE_UNSPECIFIED):
        return False
    if not memory.text.strip():
        return False
    provenance = memory.provenance
    if provenance.HasField("expires_at") and provenance.expires_at.ToDatetime(tzinfo=UTC) <= now:
        return False
    if memory.HasField("valid_from") and memory.valid_from.ToDatetime(tzinfo=UTC) > now:
        return False
    return not (memory.HasField("valid_until") and memory.valid_until.ToDatetime(tzinfo=UTC) <= now)
