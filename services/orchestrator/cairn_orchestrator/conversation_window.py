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
rendered in. The archive I/O beside them is `conversation.ConversationArchiver`;
this module imports no port, so the pure path of the loop (phases,
confirmations) never reaches the adapters' seams.

Why a line per turn and not a summary: a summary would be a model call the
caller did not ask for, and it would put the model's words where the person's
were. Clipping plus a verbatim archive loses nothing and costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cairn_libs.token_estimate import estimate_tokens
from cairn_orchestrator.domain import ConversationTurn, TurnRole

CONVERSATION_TOKEN_BOUND = 600
CONVERSATION_TURN_CHARS = 400
ARCHIVE_AT_CHARS = 800
REFERENCE_PREFIX = "recall:"
LABEL_HEAD_CHARS = 120
# The widest id the archive hands out ("r" and 18 digits): planning with it means a
# window rendered with the real, shorter ids never exceeds the bound.
_WIDEST_BLOCK_ID = "r" + "9" * 18


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
