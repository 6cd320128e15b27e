"""The earlier conversation in a prompt: which turns travel, how each is cut, and
which large blocks are archived first so nothing is lost.

The window is bounded in tokens, not turns (600 by default): the newest turns
that fit are kept, oldest first in the prompt, each clipped to 400 characters;
older turns are evicted first. A turn of at least 800 characters never travels
whole (it would be clipped or dropped), so before that happens it is archived,
verbatim, through the memory service, and its line in the window names it as
`recall:rN`; the model can bring it back word for word with the `recall` tool.
References age out of the window like any other line, so only ids still cited
travel in the prompt; blocks no longer cited stay findable with `recall_search`.

The decisions (`plan_conversation`, `window_lines`) are pure: turns in, a plan
and the blocks to archive out; the ids come back from the archive and are
rendered in. `ConversationArchiver` is the thin I/O beside them that the loop
calls while it prepares the turn: it archives what the plan names, concurrently,
never raises, and reports what it did so the trajectory can show it.

Why a line per turn and not a summary: a summary would be a model call the
caller did not ask for, and it would put the model's words where the person's
were. Clipping plus a verbatim archive loses nothing and costs nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cairn_orchestrator.domain import (
    CallCredentials,
    ConversationTurn,
    ErrorValue,
    HeldCopy,
    JSONValue,
    MemorySubject,
    TurnRole,
)
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.ports import BlockArchive

CONVERSATION_TOKEN_BOUND = 600
CONVERSATION_TURN_CHARS = 400
ARCHIVE_AT_CHARS = 800
REFERENCE_PREFIX = "recall:"
LABEL_HEAD_CHARS = 120
# The widest id the archive hands out ("r" and 18 digits): planning with it means a
# window rendered with the real, shorter ids never exceeds the bound.
_WIDEST_BLOCK_ID = "r" + "9" * 18


def estimate_tokens(text: str) -> int:
    """A deliberately simple bound (about four characters a token), good enough to
    keep a window small; the gateway counts real usage."""
    return math.ceil(len(text) / 4)


def clip_turn(text: str, *, limit: int = CONVERSATION_TURN_CHARS) -> str:
    """The turn on one line, at most `limit` characters, ending in … when cut."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


# ---------------------------------------------------------------- the pure plan


@dataclass(frozen=True, slots=True)
class BlockToArchive:
    """A large earlier turn, verbatim, to keep in the archive before it is cut."""

    turn: int  # its index among the earlier turns, 0 = the oldest
    role: TurnRole
    content: str
    label: str


@dataclass(frozen=True, slots=True)
class WindowEntry:
    """One earlier turn that travels in the prompt."""

    turn: int
    role: TurnRole
    text: str  # clipped, one line
    chars: int  # the whole turn's length
    clipped: bool
    archived: bool  # large: its line names its archived block, once it has an id


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    turns: int
    entries: tuple[WindowEntry, ...]  # oldest first
    to_archive: tuple[BlockToArchive, ...]  # every large turn, kept or evicted, oldest first

    @property
    def evicted(self) -> int:
        return self.turns - len(self.entries)


def block_label(turn: ConversationTurn) -> str:
    """What the archive shows and searches a block by: who said it, how long, how it began."""
    return f"{turn.role} message, {len(turn.content)} characters: {clip_turn(turn.content, limit=LABEL_HEAD_CHARS)}"


def _line(entry: WindowEntry, block_id: str | None) -> str:
    if not entry.archived:
        return f"{entry.role}: {entry.text}"
    cut = "clipped" if entry.clipped else "whole"
    if block_id is None:
        return f"{entry.role} ({entry.chars} characters, {cut}; not archived): {entry.text}"
    return (
        f"{entry.role} ({entry.chars} characters, {cut}; the whole message is "
        f"{REFERENCE_PREFIX}{block_id}): {entry.text}"
    )


def _planned_cost(entry: WindowEntry) -> int:
    if not entry.archived:
        return estimate_tokens(_line(entry, None))
    return max(estimate_tokens(_line(entry, None)), estimate_tokens(_line(entry, _WIDEST_BLOCK_ID)))


def plan_conversation(
    turns: Sequence[ConversationTurn],
    *,
    token_bound: int = CONVERSATION_TOKEN_BOUND,
    turn_chars: int = CONVERSATION_TURN_CHARS,
    archive_at: int = ARCHIVE_AT_CHARS,
) -> ConversationPlan:
    """Which turns travel (the newest that fit the bound, oldest evicted first) and
    which large turns must be archived first (all of them: each is cut either way)."""
    kept: list[WindowEntry] = []
    used = 0
    for index in range(len(turns) - 1, -1, -1):
        turn = turns[index]
        text = clip_turn(turn.content, limit=turn_chars)
        entry = WindowEntry(
            turn=index,
            role=turn.role,
            text=text,
            chars=len(turn.content),
            clipped=len(" ".join(turn.content.split())) > turn_chars,
            archived=len(turn.content) >= archive_at,
        )
        cost = _planned_cost(entry)
        if used + cost > token_bound:
            break
        kept.append(entry)
        used += cost
    to_archive = tuple(
        BlockToArchive(turn=index, role=turn.role, content=turn.content, label=block_label(turn))
        for index, turn in enumerate(turns)
        if len(turn.content) >= archive_at
    )
    return ConversationPlan(turns=len(turns), entries=tuple(reversed(kept)), to_archive=to_archive)


def window_lines(plan: ConversationPlan, block_ids: Mapping[int, str]) -> tuple[str, ...]:
    """The window as prompt lines; an archived turn names its block (by turn index)."""
    return tuple(_line(entry, block_ids.get(entry.turn)) for entry in plan.entries)


def cited_block_ids(plan: ConversationPlan, block_ids: Mapping[int, str]) -> tuple[str, ...]:
    """The archived blocks the window still names: the only ids that travel."""
    return tuple(
        block_ids[entry.turn]
        for entry in plan.entries
        if entry.archived and entry.turn in block_ids
    )


def conversation_window(
    turns: Sequence[ConversationTurn],
    *,
    token_bound: int = CONVERSATION_TOKEN_BOUND,
    turn_chars: int = CONVERSATION_TURN_CHARS,
) -> tuple[str, ...]:
    """The window with nothing archived (no archive at hand): same bound, same cuts."""
    plan = plan_conversation(turns, token_bound=token_bound, turn_chars=turn_chars)
    return window_lines(plan, {})


# ---------------------------------------------------------------- the archive I/O


@dataclass(frozen=True, slots=True)
class CompactedConversation:
    """What the loop puts in the prompt, and what the trajectory says about it.
    `copies`: the archived turns' text, under each subject their blocks are about,
    so an erasure of the subject reaches the run's copies of them too (I9)."""

    lines: tuple[str, ...]
    detail: Mapping[str, JSONValue]
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
        detail: dict[str, JSONValue] = {
            "conversation_id": conversation_id,
            "turns": plan.turns,
            "window_turns": len(plan.entries),
            "evicted_turns": plan.evicted,
            "clipped_turns": sum(1 for e in plan.entries if e.clipped),
            "window_tokens": sum(estimate_tokens(line) for line in lines),
            "archived": [
                {
                    "turn": block.turn,
                    "role": block.role,
                    "chars": len(block.content),
                    "block_id": block_ids.get(block.turn, ""),
                    "already_archived": block.turn in reused,
                }
                for block in plan.to_archive
            ],
            "cited_block_ids": list(cited_block_ids(plan, block_ids)),
        }
        if note:
            detail["note"] = note
        error: ErrorValue | None = None
        if failures:
            failures.sort()
            detail["failed_turns"] = [turn for turn, _ in failures]
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
