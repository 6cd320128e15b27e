"""The memory block of a prompt, rendered by the shared renderer.

`cairn_libs.memory_block.render_memories` is the one place that decides how a
memory reads to a model (its origin, its claim type, the pinned sentence that a
memory is never on its own a reason to accept or reject anybody; I9), and it
speaks memory protos. The loop keeps plain RecalledMemory values, so this module
rebuilds the proto fields the renderer reads, and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from google.protobuf import timestamp_pb2

from cairn.memory.v1 import memory_pb2
from cairn_libs.memory_block import render_memories
from cairn_orchestrator.domain import RecalledMemory

_SUBJECT_KINDS = {n.removeprefix("SUBJECT_KIND_"): v for n, v in memory_pb2.SubjectKind.items()}
_CLAIM_TYPES = {n.removeprefix("CLAIM_TYPE_"): v for n, v in memory_pb2.ClaimType.items()}
_STATES = {n.removeprefix("MEMORY_STATE_"): v for n, v in memory_pb2.MemoryState.items()}
_AUTHOR_KINDS = {n.removeprefix("AUTHOR_KIND_"): v for n, v in memory_pb2.AuthorKind.items()}


def _timestamp(moment: datetime) -> timestamp_pb2.Timestamp:
    value = timestamp_pb2.Timestamp()
    value.FromDatetime(moment)
    return value


def memory_to_proto(memory: RecalledMemory) -> memory_pb2.Memory:
    message = memory_pb2.Memory(
        memory_id=memory.memory_id,
        text=memory.text,
        subject=memory_pb2.Subject(
            kind=_SUBJECT_KINDS.get(memory.subject_kind, memory_pb2.SUBJECT_KIND_UNSPECIFIED),
            id=memory.subject_id,
        ),
        claim_type=_CLAIM_TYPES.get(memory.claim_type, memory_pb2.CLAIM_TYPE_UNSPECIFIED),
        state=_STATES.get(memory.state, memory_pb2.MEMORY_STATE_UNSPECIFIED),
        score=memory.score,
        provenance=memory_pb2.Provenance(
            author_kind=_AUTHOR_KINDS.get(memory.author_kind, memory_pb2.AUTHOR_KIND_UNSPECIFIED),
            author_id=memory.author_id,
            run_id=memory.run_id,
        ),
    )
    if memory.created_at is not None:
        message.provenance.created_at.CopyFrom(_timestamp(memory.created_at))
    if memory.expires_at is not None:
        message.provenance.expires_at.CopyFrom(_timestamp(memory.expires_at))
    if memory.valid_from is not None:
        message.valid_from.CopyFrom(_timestamp(memory.valid_from))
    if memory.valid_until is not None:
        message.valid_until.CopyFrom(_timestamp(memory.valid_until))
    return message


def render_memory_block(memories: Sequence[RecalledMemory], *, now: datetime) -> str:
    """The fenced memory block (already fenced by the renderer)."""
    return render_memories([memory_to_proto(m) for m in memories], now=now)
