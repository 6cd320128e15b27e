"""The conversation archiver: the I/O beside the pure window plan.

`conversation_window.py` decides which earlier turns travel in the prompt and
which large ones must be archived first; `ConversationArchiver` is what the loop
calls while it prepares the turn: it archives what the plan names, through the
caller's own credentials, concurrently, never raises, and reports what it did so
the trajectory can show it. It sits apart from the plan so the pure path of the
loop imports no port.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cairn_libs.token_estimate import estimate_tokens
from cairn_orchestrator.conversation_window import (
    BlockToArchive,
    ConversationPlan,
    cited_block_ids,
    clip_turn,
    window_lines,
)
from cairn_orchestrator.domain import (
    ArchivedTurnDetail,
    CallCredentials,
    ConversationArchiveDetail,
    ErrorValue,
    HeldCopy,
    MemorySubject,
)
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.ports import BlockArchive


@dataclass(frozen=True, slots=True)
class CompactedConversation:
    """What the loop puts in the prompt, and what the trajectory says about it.
    `copies`: the archived turns' text, under each subject their blocks are about,
    so an erasure of the subject reaches the run's copies of them too (I9)."""

    lines: tuple[str, ...]
    detail: ConversationArchiveDetail
    error: ErrorValue | None = None
    copies: tuple[HeldCopy, ...] = ()


@dataclass(slots=True)
class _RecentlyArchived:
    """Blocks this process archived lately, so a client that sends the same long
    message with every turn costs no Archive call and the trajectory can say the
    block was already kept. Bounded, and a restart forgets it; copies are not the
    concern, since the memory service returns the block already kept for the same
    content in the same conversation."""

    capacity: int = 4096
    _ids: OrderedDict[tuple[str, ...], str] = field(default_factory=OrderedDict)

    def get(self, key: tuple[str, ...]) -> str | None:
        block_id = self._ids.get(key)
        if block_id is not None:
            self._ids.move_to_end(key)
        return block_id

    def put(self, key: tuple[str, ...], block_id: str) -> None:
        self._ids[key] = block_id
        self._ids.move_to_end(key)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


def _archive_error(exc: DependencyFailed) -> ErrorValue:
    return ErrorValue(f"memory.{exc.status_code.lower()}", exc.message)


class ConversationArchiver:
    """Archives the large earlier turns a plan names, through the caller's own
    credentials (the archive is theirs), before the window cuts them."""

    def __init__(self, archive: BlockArchive | None, *, cache_size: int = 4096) -> None:
        self._archive = archive
        self._recent = _RecentlyArchived(capacity=cache_size)

    async def compact(
        self,
        plan: ConversationPlan,
        *,
        org_id: str,
        user_id: str,
        conversation_id: str,
        credentials: CallCredentials,
        deadline_seconds: float,
        subjects: Sequence[MemorySubject] = (),
    ) -> CompactedConversation:
        """The window the plan describes, with the large turns archived first and
        referenced; never raises (a turn whose archiving failed travels clipped
        and unreferenced, and the result says so)."""
        block_ids: dict[int, str] = {}
        failures: list[tuple[int, ErrorValue]] = []
        reused: set[int] = set()
        note = ""
        if plan.to_archive and self._archive is None:
            note = (
                "this deployment keeps no memories, so large turns were clipped without archiving"
            )
        elif plan.to_archive:

            async def keep(block: BlockToArchive) -> None:
                key = (
                    org_id,
                    user_id,
                    conversation_id,
                    block.role,
                    hashlib.sha256(block.content.encode()).hexdigest(),
                )
                known = self._recent.get(key)
                if known is not None:
                    block_ids[block.turn] = known
                    reused.add(block.turn)
                    return
                assert self._archive is not None
                try:
                    block_id = await self._archive.archive(
                        label=block.label,
                        role=block.role,
                        content=block.content,
                        conversation_id=conversation_id,
                        credentials=credentials,
                        deadline_seconds=deadline_seconds,
                        subjects=subjects,
                    )
                except DependencyFailed as exc:
                    failures.append((block.turn, _archive_error(exc)))
                    return
                self._recent.put(key, block_id)
                block_ids[block.turn] = block_id

            await asyncio.gather(*(keep(block) for block in plan.to_archive))

        lines = window_lines(plan, block_ids)
        error: ErrorValue | None = None
        failures.sort()
        detail = ConversationArchiveDetail(
            conversation_id=conversation_id,
            turns=plan.turns,
            window_turns=len(plan.entries),
            evicted_turns=plan.evicted,
            clipped_turns=sum(1 for e in plan.entries if e.clipped),
            window_tokens=sum(estimate_tokens(line) for line in lines),
            archived=tuple(
                ArchivedTurnDetail(
                    turn=block.turn,
                    role=block.role,
                    chars=len(block.content),
                    block_id=block_ids.get(block.turn, ""),
                    already_archived=block.turn in reused,
                )
                for block in plan.to_archive
            ),
            cited_block_ids=cited_block_ids(plan, block_ids),
            note=note,
            failed_turns=tuple(turn for turn, _ in failures),
        )
        if failures:
            first = failures[0][1]
            error = ErrorValue(
                first.code,
                f"{len(failures)} of {len(plan.to_archive)} large turns could not be archived "
                f"and travel clipped without a reference: {first.message}",
            )
        about = (MemorySubject("USER", user_id), *subjects)
        copies = tuple(
            HeldCopy(subject.kind, subject.id, text)
            for block in plan.to_archive
            if block.turn in block_ids
            # The turn verbatim (earlier_turns) and as its window line (the prompt).
            for text in (block.content, clip_turn(block.content).removesuffix("…"))
            for subject in about
        )
        return CompactedConversation(lines=lines, detail=detail, error=error, copies=copies)
