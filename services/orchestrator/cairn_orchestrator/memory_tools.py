"""The built-in memory tools: what an agent may keep, change and look up in the
memory service during a run, and what a person reads before a write happens.

    remember         write  keep one sentence about a subject (confirmed first)
    update_profile   write  set a stable keyed fact about a subject (confirmed first)
    recall_memory    read   memories (and a subject's profile) for a query
    recall           read   one archived conversation block, verbatim, by its r<N> id
    recall_search    read   search the archived blocks

Every call goes out with the caller's own token (whose memories: I1) and the
run's actor token, from which the memory service records the author as the
agent in this run, never a person (I9); nothing the model writes can name an
author. The confirmation card of a write says what will be kept, about whom,
that an agent and not a person writes it, until when it is kept, and warns when
it is personal data (I4).

A write handed over twice (the loop may, after a crash around an approved
write) takes effect once: Remember keeps one memory per text and subject and
says `already_held`, UpdateProfile to the value already held changes nothing,
and a `previous_value` refused because the new value is already in place is
read as the earlier attempt's success.

Failures are data: a memory service error comes back as `memory.<cause>` with
the service's own message, except a denial, which reads like every denial (I6).
In a deployment that keeps no memories the tools answer that plainly; the two
writes are then registered as reads, because a call that cannot change anything
is not worth a person's confirmation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Final

from cairn_libs.clock import Clock
from cairn_libs.errors import DENIAL_MESSAGE
from cairn_libs.memory_block import NEVER_A_REASON
from cairn_orchestrator.domain import (
    SUBJECT_KINDS,
    ArchivedBlock,
    CardDetail,
    CardLanguage,
    ClaimTypeName,
    ConfirmationCard,
    ErrorValue,
    HeldCopy,
    JSONValue,
    MemorySubject,
    ProfileFact,
    RecalledMemory,
    SubjectKindName,
)
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.ports import MemoryService
from cairn_orchestrator.tools import Tool, ToolContext, ToolHandler, ToolResult

REMEMBER: Final = "remember"
UPDATE_PROFILE: Final = "update_profile"
RECALL_MEMORY: Final = "recall_memory"
RECALL: Final = "recall"
RECALL_SEARCH: Final = "recall_search"
MEMORY_TOOL_NAMES: Final = (REMEMBER, UPDATE_PROFILE, RECALL_MEMORY, RECALL, RECALL_SEARCH)

NO_MEMORIES: Final = "this deployment keeps no memories"
DEFAULT_MEMORY_TTL: Final = timedelta(days=90)
DEFAULT_RECALL_K: Final = 5
MAX_RECALL_K: Final = 20
EXCERPT_CHARS: Final = 280
REFERENCE_PREFIX: Final = "recall:"

# Memory service statuses as the tool error codes a model reads.
_ERROR_CODES: Final = {
    "INVALID_ARGUMENT": "memory.invalid_input",
    "FAILED_PRECONDITION": "memory.conflict",
    "PERMISSION_DENIED": "memory.denied",
    "UNAUTHENTICATED": "memory.denied",
    "RESOURCE_EXHAUSTED": "memory.exhausted",
    "UNAVAILABLE": "memory.unavailable",
    "DEADLINE_EXCEEDED": "memory.unavailable",
    "UNIMPLEMENTED": "memory.not_configured",
}
MEMORY_FAILED: Final = "memory.failed"
MEMORY_SEALED: Final = "memory.sealed"

# How the model reads a memory's claim type.
_CLAIMS_FOR_MODEL: Final[dict[str, str]] = {
    "USER_STATEMENT": "a user's statement",
    "INFERENCE": "an inference",
    "UNKNOWN": "unknown",
}
# How a card names it, per language.
_CLAIMS: Final[dict[str, dict[str, str]]] = {
    "en": {
        "USER_STATEMENT": "a user's statement",
        "INFERENCE": "an inference",
        "UNKNOWN": "not stated (the agent did not say)",
    },
    "zh-Hans": {
        "USER_STATEMENT": "用户本人的陈述",
        "INFERENCE": "推断",
        "UNKNOWN": "未说明（智能体没有说明）",
    },
}


# ---------------------------------------------------------------- argument schemas

SUBJECT_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "description": (
        "Whom the memory is about. WORKSPACE: the team or company, not a person (no id). "
        "USER: a colleague using this assistant; leave out the id to mean the person you "
        "are talking with. CANDIDATE, EMPLOYEE, CUSTOMER: a person, named by id."
    ),
    "properties": {
        "kind": {"enum": list(SUBJECT_KINDS)},
        "id": {"type": "string", "maxLength": 256},
    },
    "required": ["kind"],
    "additionalProperties": False,
    "allOf": [
        {
            "if": {"properties": {"kind": {"const": "WORKSPACE"}}},
            "then": {"properties": {"id": {"maxLength": 0}}},
        },
        {
            "if": {"properties": {"kind": {"enum": ["CANDIDATE", "EMPLOYEE", "CUSTOMER"]}}},
            "then": {"required": ["id"], "properties": {"id": {"pattern": r"\S"}}},
        },
    ],
}

REMEMBER_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "text": {
            "type": "string",
            "minLength": 1,
            "maxLength": 300,
            "pattern": r"^[^\r\n]*\S[^\r\n]*$",
            "description": "One sentence to keep, on one line, e.g. 'Prefers answers in German.'",
        },
        "subject": SUBJECT_SCHEMA,
        "claim_type": {
            "enum": ["USER_STATEMENT", "INFERENCE"],
            "description": "USER_STATEMENT when the person said it; INFERENCE when you concluded it.",
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 64},
            "maxItems": 20,
        },
        "importance": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["text", "subject"],
    "additionalProperties": False,
}

UPDATE_PROFILE_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "subject": SUBJECT_SCHEMA,
        "key": {
            "type": "string",
            "pattern": "^[a-z][a-z0-9_]{0,63}$",
            "description": "The fact's name in snake_case, e.g. 'preferred_language'.",
        },
        "value": {
            "type": "string",
            "minLength": 1,
            "maxLength": 300,
            "pattern": r"^[^\r\n]*\S[^\r\n]*$",
            "description": "The new value, on one line.",
        },
        "previous_value": {
            "type": "string",
            "maxLength": 300,
            "description": (
                "The value you believe is current (read it with recall_memory); the change "
                "is refused if the fact no longer holds it. Leave out if you do not know it."
            ),
        },
    },
    "required": ["subject", "key", "value"],
    "additionalProperties": False,
}

RECALL_MEMORY_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "query": {
            "type": "string",
            "maxLength": 2000,
            "description": "What to look for; leave empty for the newest memories.",
        },
        "subject": SUBJECT_SCHEMA,
        "k": {"type": "integer", "minimum": 1, "maximum": MAX_RECALL_K},
    },
    "additionalProperties": False,
}

RECALL_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "id": {
            "type": "string",
            "pattern": r"^\s*(recall:)?[rR]?[0-9]{1,18}\s*$",
            "description": "The block's id as the conversation names it, e.g. 'recall:r7' or 'r7'.",
        }
    },
    "required": ["id"],
    "additionalProperties": False,
}

RECALL_SEARCH_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 2000},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20},
    },
    "required": ["query"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------- pure parts


def resolve_subject(raw: Mapping[str, Any], *, caller_id: str) -> MemorySubject:
    """The subject the arguments name; USER without an id is the person asking."""
    kind_name = str(raw.get("kind", "WORKSPACE"))
    kind: SubjectKindName = next((k for k in SUBJECT_KINDS if k == kind_name), "WORKSPACE")
    subject_id = str(raw.get("id", "")).strip()
    if kind == "USER" and not subject_id:
        subject_id = caller_id
    return MemorySubject(kind=kind, id="" if kind == "WORKSPACE" else subject_id)


_SUBJECT_KIND_WORDS: Final[dict[str, str]] = {
    "USER": "用户",
    "CANDIDATE": "候选人",
    "EMPLOYEE": "员工",
    "CUSTOMER": "客户",
}

# What a person reads on a write's card, in each language cairn writes cards in.
# One table per language, so a label cannot be translated in one card and not in
# another; the tests check both tables have the same keys.
CARD_TEXT: Final[dict[str, dict[str, str]]] = {
    "en": {
        "workspace": "the workspace (not a person)",
        "asking": "{described} (the person asking)",
        "what": "What will be kept",
        "about": "About",
        "written_by": "Written by",
        "written_by_value": (
            "an agent ({agent}, in run {run_id}), not a person; everyone who reads it is told so"
        ),
        "claim": "Claim",
        "kept_until": "Kept until",
        "kept_until_value": "{day} ({duration} from now), unless it is erased sooner",
        "tags": "Tags",
        "tags_joiner": ", ",
        "importance": "Importance",
        "importance_value": "{n} of 5",
        "personal_data": (
            "Personal data: this is about a person ({about}). Assistants in your organisation "
            "may be shown it until {day}; the person may ask to see everything held "
            "about them and to have it erased."
        ),
        "inference": "This is the agent's own inference about a person, not something they said.",
        "remember_summary": 'Keep a memory about {about}: "{text}"',
        "fact": "Fact",
        "old_value": "Old value",
        "old_value_known": '"{previous}" (the change is refused if the fact no longer holds this)',
        "old_value_unknown": (
            "not known to the agent; any current value stays in the fact's history"
        ),
        "new_value": "New value",
        "profile_summary": 'Set {key} for {about} to "{value}"',
        "day": "{n} day",
        "days": "{n} days",
        "hour": "{n} hour",
        "hours": "{n} hours",
    },
    "zh-Hans": {
        "workspace": "工作区（不是个人）",
        "asking": "{described}（提问者本人）",
        "what": "将保存的内容",
        "about": "关于",
        "written_by": "写入者",
        "written_by_value": (
            "智能体（{agent}，运行 {run_id}），不是人；每个读到它的人都会被告知这一点"
        ),
        "claim": "信息性质",
        "kept_until": "保存至",
        "kept_until_value": "{day}（从现在起 {duration}），除非提前被删除",
        "tags": "标签",
        "tags_joiner": "、",
        "importance": "重要程度",
        "importance_value": "{n}/5",
        "personal_data": (
            "个人数据：这条信息涉及一个人（{about}）。在 {day} 之前，你所在组织的助手可能会"
            "看到它；当事人可以要求查看关于自己的全部信息，并要求删除。"
        ),
        "inference": "这是智能体自己对某个人的推断，而不是当事人说过的话。",
        "remember_summary": "保存一条关于{about}的记忆：“{text}”",
        "fact": "资料项",
        "old_value": "原值",
        "old_value_known": "“{previous}”（如果该资料项已不是这个值，更改会被拒绝）",
        "old_value_unknown": "智能体不知道；当前的值会保留在该资料项的历史记录中",
        "new_value": "新值",
        "profile_summary": "将{about}的 {key} 设为“{value}”",
        "day": "{n} 天",
        "days": "{n} 天",
        "hour": "{n} 小时",
        "hours": "{n} 小时",
    },
}


def _texts(language: str) -> dict[str, str]:
    return CARD_TEXT.get(language, CARD_TEXT["en"])


def _card_language(context: ToolContext) -> CardLanguage:
    return "zh-Hans" if context.language == "zh-Hans" else "en"


def describe_subject(subject: MemorySubject, *, caller_id: str = "", language: str = "en") -> str:
    texts = _texts(language)
    if not subject.is_person:
        return texts["workspace"]
    if language == "zh-Hans":
        described = f"{_SUBJECT_KIND_WORDS.get(subject.kind, subject.kind.lower())} {subject.id}"
    else:
        described = f"{subject.kind.lower()} {subject.id}"
    if subject.kind == "USER" and subject.id == caller_id:
        return texts["asking"].format(described=described)
    return described


def claim_type_of(arguments: Mapping[str, Any]) -> ClaimTypeName:
    raw = arguments.get("claim_type")
    if raw == "USER_STATEMENT":
        return "USER_STATEMENT"
    if raw == "INFERENCE":
        return "INFERENCE"
    return "UNKNOWN"


def duration_words(span: timedelta, *, language: str = "en") -> str:
    texts = _texts(language)
    days = span / timedelta(days=1)
    if days >= 1:
        whole = round(days)
        return texts["day" if whole == 1 else "days"].format(n=whole)
    hours = max(round(span / timedelta(hours=1)), 1)
    return texts["hour" if hours == 1 else "hours"].format(n=hours)


def _day(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d")


def _written_by(context: ToolContext, texts: Mapping[str, str]) -> CardDetail:
    return CardDetail(
        texts["written_by"],
        texts["written_by_value"].format(agent=context.agent, run_id=context.run_id),
    )


def _kept_until(
    now: datetime, ttl: timedelta, texts: Mapping[str, str], language: str
) -> CardDetail:
    return CardDetail(
        texts["kept_until"],
        texts["kept_until_value"].format(
            day=_day(now + ttl), duration=duration_words(ttl, language=language)
        ),
    )


def _personal_data_warning(about: str, *, until: datetime, texts: Mapping[str, str]) -> str:
    return texts["personal_data"].format(about=about, day=_day(until))


def remember_card(
    arguments: Mapping[str, Any], context: ToolContext, *, now: datetime, ttl: timedelta
) -> ConfirmationCard:
    """What a person reads before an agent keeps a memory, in the run's language."""
    language = _card_language(context)
    texts = _texts(language)
    caller = context.principal.user_id
    subject = resolve_subject(arguments.get("subject", {}), caller_id=caller)
    about = describe_subject(subject, caller_id=caller, language=language)
    text = " ".join(str(arguments.get("text", "")).split())
    claim = claim_type_of(arguments)
    details = [
        CardDetail(texts["what"], text),
        CardDetail(texts["about"], about),
        _written_by(context, texts),
        CardDetail(texts["claim"], _CLAIMS[language][claim]),
        _kept_until(now, ttl, texts, language),
    ]
    tags = [str(t) for t in arguments.get("tags", ())]
    if tags:
        details.append(CardDetail(texts["tags"], texts["tags_joiner"].join(tags)))
    if "importance" in arguments:
        details.append(
            CardDetail(
                texts["importance"], texts["importance_value"].format(n=arguments["importance"])
            )
        )
    warnings: list[str] = []
    if subject.is_person:
        warnings.append(_personal_data_warning(about, until=now + ttl, texts=texts))
        if claim == "INFERENCE":
            warnings.append(texts["inference"])
    return ConfirmationCard(
        summary=texts["remember_summary"].format(about=about, text=text),
        details=tuple(details),
        warnings=tuple(warnings),
        language=language,
    )


def update_profile_card(
    arguments: Mapping[str, Any], context: ToolContext, *, now: datetime, ttl: timedelta
) -> ConfirmationCard:
    """What a person reads before an agent changes a profile fact, in the run's language."""
    language = _card_language(context)
    texts = _texts(language)
    caller = context.principal.user_id
    subject = resolve_subject(arguments.get("subject", {}), caller_id=caller)
    about = describe_subject(subject, caller_id=caller, language=language)
    key = str(arguments.get("key", ""))
    value = " ".join(str(arguments.get("value", "")).split())
    previous = arguments.get("previous_value")
    old_value = (
        texts["old_value_known"].format(previous=previous)
        if isinstance(previous, str)
        else texts["old_value_unknown"]
    )
    details = (
        CardDetail(texts["fact"], key),
        CardDetail(texts["about"], about),
        CardDetail(texts["old_value"], old_value),
        CardDetail(texts["new_value"], value),
        _written_by(context, texts),
        _kept_until(now, ttl, texts, language),
    )
    warnings = (
        (_personal_data_warning(about, until=now + ttl, texts=texts),) if subject.is_person else ()
    )
    return ConfirmationCard(
        summary=texts["profile_summary"].format(key=key, about=about, value=value),
        details=details,
        warnings=warnings,
        language=language,
    )


def memory_error(exc: DependencyFailed, *, writing: bool = False) -> ErrorValue:
    """A memory service failure as the data a model reads."""
    code = _ERROR_CODES.get(exc.status_code, MEMORY_FAILED)
    if code == "memory.denied":
        return ErrorValue(code, DENIAL_MESSAGE)  # I6: one message for every refusal
    if code == "memory.unavailable":
        outcome = (
            "it may or may not have been written; check with recall_memory before trying again"
            if writing and exc.status_code == "DEADLINE_EXCEEDED"
            else ("nothing was written" if writing else "nothing could be read")
        )
        return ErrorValue(code, f"the memory service is unavailable ({exc.status_code}); {outcome}")
    return ErrorValue(code, exc.detail or exc.message)


def origin_of(author_kind: str, author_id: str, run_id: str, created_at: datetime | None) -> str:
    day = _day(created_at) if created_at is not None else "an unknown date"
    if author_kind == "MODEL":
        return f"written by an agent in run {run_id or 'unknown'} on {day}"
    if author_kind == "PERSON":
        return f"noted by {author_id} on {day}"
    return f"of unknown origin, kept on {day}"


def _subject_words(kind: str, subject_id: str) -> str:
    if kind == "WORKSPACE" or not subject_id:
        return "the workspace" if kind == "WORKSPACE" else kind.lower()
    return f"{kind.lower()} {subject_id}"


def shown_now(memory: RecalledMemory, *, now: datetime) -> bool:
    """The same rule as the memory block of a prompt: active, readable, in force."""
    if memory.state not in ("ACTIVE", "UNSPECIFIED", ""):
        return False
    if not memory.text.strip():
        return False
    if memory.expires_at is not None and memory.expires_at <= now:
        return False
    if memory.valid_from is not None and memory.valid_from > now:
        return False
    return not (memory.valid_until is not None and memory.valid_until <= now)


def memory_copies(memories: Sequence[RecalledMemory]) -> tuple[HeldCopy, ...]:
    """The texts about people a read of these memories copies into the run (I9)."""
    return tuple(HeldCopy(m.subject_kind, m.subject_id, m.text) for m in memories if m.text.strip())


def fact_copies(facts: Sequence[ProfileFact]) -> tuple[HeldCopy, ...]:
    return tuple(
        HeldCopy(f.subject_kind, f.subject_id, value)
        for f in facts
        for value in (f.value, *f.earlier_values)
        if value.strip()
    )


def block_copies(blocks: Sequence[ArchivedBlock], *, verbatim: bool) -> tuple[HeldCopy, ...]:
    """A block's text (as the model reads it: whole, or its excerpt) under each subject
    it is about."""
    copies: list[HeldCopy] = []
    for block in blocks:
        shown = block.content if verbatim else _excerpt(block.content).removesuffix("…")
        for texts in (shown, block.label):
            if texts.strip():
                copies.extend(HeldCopy(a.kind, a.id, texts) for a in block.subjects)
    return tuple(copies)


def _excerpt(content: str) -> str:
    flat = " ".join(content.split())
    return flat if len(flat) <= EXCERPT_CHARS else flat[: EXCERPT_CHARS - 1] + "…"


def memory_json(memory: RecalledMemory) -> dict[str, JSONValue]:
    return {
        "memory_id": memory.memory_id,
        "text": memory.text,
        "about": _subject_words(memory.subject_kind, memory.subject_id),
        "origin": origin_of(memory.author_kind, memory.author_id, memory.run_id, memory.created_at),
        "claim_type": _CLAIMS_FOR_MODEL.get(memory.claim_type, "unknown"),
        "kept_until": _day(memory.expires_at) if memory.expires_at is not None else "",
    }


def fact_json(fact: ProfileFact) -> dict[str, JSONValue]:
    return {
        "key": fact.key,
        "value": fact.value,
        "about": _subject_words(fact.subject_kind, fact.subject_id),
        "origin": origin_of(fact.author_kind, fact.author_id, fact.run_id, fact.created_at),
        "earlier_values": list(fact.earlier_values),
        "kept_until": _day(fact.expires_at) if fact.expires_at is not None else "",
    }


def block_json(block: ArchivedBlock, *, verbatim: bool) -> dict[str, JSONValue]:
    content: dict[str, JSONValue] = {
        "id": f"{REFERENCE_PREFIX}{block.block_id}",
        "label": block.label,
        "role": block.role,
        "conversation_id": block.conversation_id,
        "archived_on": _day(block.created_at) if block.created_at is not None else "",
    }
    if verbatim:
        content["content"] = block.content
    else:
        content["excerpt"] = _excerpt(block.content)
    return content


def block_id_of(raw: str) -> str:
    """'recall:r7', 'R7 ' and '7' all name block r7."""
    return "r" + raw.strip().removeprefix(REFERENCE_PREFIX).lstrip("rR")


# ---------------------------------------------------------------- the tools


def memory_tools(
    memory: MemoryService | None,
    *,
    clock: Clock,
    ttl: timedelta = DEFAULT_MEMORY_TTL,
    timeout_seconds: float = 15.0,
) -> tuple[Tool, ...]:
    """The five memory tools over `memory`, or, with None, the plain answers of a
    deployment that keeps no memories."""
    if memory is None:
        return _without_memory()
    return (
        _remember(memory, clock=clock, ttl=ttl, timeout=timeout_seconds),
        _update_profile(memory, clock=clock, ttl=ttl, timeout=timeout_seconds),
        _recall_memory(memory, clock=clock, timeout=timeout_seconds),
        _recall(memory, timeout=timeout_seconds),
        _recall_search(memory, timeout=timeout_seconds),
    )


_REMEMBER_DESCRIPTION = (
    "Keep one sentence in long-term memory about a person or the workspace, for later "
    "conversations. A person confirms before it is kept; it is recorded as written by "
    "you (an agent), and it expires. Never keep secrets, and keep only what will help later."
)
_UPDATE_PROFILE_DESCRIPTION = (
    "Set a stable keyed fact (e.g. preferred_language) about a person or the workspace; "
    "the old value stays in its history. A person confirms before it changes."
)
_RECALL_MEMORY_DESCRIPTION = (
    "Look up what is remembered: memories that match a query, optionally about one "
    "subject (then with its profile facts). Each says who wrote it and when."
)
_RECALL_DESCRIPTION = (
    "Bring back, word for word, an earlier conversation message that was archived; "
    "the conversation names it as recall:r<N>."
)
_RECALL_SEARCH_DESCRIPTION = (
    "Search the archived earlier conversation messages; returns their ids and an "
    "excerpt; bring one back in full with the recall tool."
)


def _remember(memory: MemoryService, *, clock: Clock, ttl: timedelta, timeout: float) -> Tool:
    async def handler(
        arguments: Mapping[str, Any], context: ToolContext
    ) -> ToolResult | ErrorValue:
        subject = resolve_subject(arguments["subject"], caller_id=context.principal.user_id)
        try:
            outcome = await memory.remember(
                # Exactly the text the card showed the person who approved it.
                text=" ".join(str(arguments["text"]).split()),
                subject=subject,
                claim_type=claim_type_of(arguments),
                tags=[str(t) for t in arguments.get("tags", ())],
                importance=int(arguments.get("importance", 0)),
                credentials=context.credentials,
                deadline_seconds=timeout,
            )
        except DependencyFailed as exc:
            return memory_error(exc, writing=True)
        kept = outcome.memory
        return ToolResult(
            content={
                "kept": True,
                "already_held": outcome.already_held,
                "memory_id": kept.memory_id,
                "text": kept.text,
                "about": _subject_words(kept.subject_kind, kept.subject_id),
                "origin": origin_of(kept.author_kind, kept.author_id, kept.run_id, kept.created_at),
                "kept_until": _day(kept.expires_at) if kept.expires_at is not None else "",
            },
            copies=memory_copies([kept]),
        )

    def card(arguments: Mapping[str, Any], context: ToolContext) -> ConfirmationCard:
        return remember_card(arguments, context, now=clock.now(), ttl=ttl)

    def copies_of(arguments: Mapping[str, Any], context: ToolContext) -> tuple[HeldCopy, ...]:
        subject = resolve_subject(arguments["subject"], caller_id=context.principal.user_id)
        return (HeldCopy(subject.kind, subject.id, " ".join(str(arguments["text"]).split())),)

    return Tool(
        name=REMEMBER,
        description=_REMEMBER_DESCRIPTION,
        parameters=REMEMBER_SCHEMA,
        effect="write",
        handler=handler,
        card=card,
        copies_of=copies_of,
    )


def _update_profile(memory: MemoryService, *, clock: Clock, ttl: timedelta, timeout: float) -> Tool:
    async def handler(
        arguments: Mapping[str, Any], context: ToolContext
    ) -> ToolResult | ErrorValue:
        subject = resolve_subject(arguments["subject"], caller_id=context.principal.user_id)
        key = str(arguments["key"])
        value = " ".join(str(arguments["value"]).split())
        previous = arguments.get("previous_value")
        try:
            fact = await memory.update_profile(
                subject=subject,
                key=key,
                value=value,
                previous_value=previous if isinstance(previous, str) else None,
                credentials=context.credentials,
                deadline_seconds=timeout,
            )
        except DependencyFailed as exc:
            if exc.status_code == "FAILED_PRECONDITION":
                # An approved change handed over a second time (after a crash) finds
                # its own value in place: that is the change done, not a conflict.
                current = await _current_fact(
                    memory, subject, key, context, deadline_seconds=timeout
                )
                if current is not None and current.value == value:
                    return ToolResult(
                        content={"updated": True, **fact_json(current)},
                        copies=fact_copies([current]),
                    )
            return memory_error(exc, writing=True)
        return ToolResult(content={"updated": True, **fact_json(fact)}, copies=fact_copies([fact]))

    def card(arguments: Mapping[str, Any], context: ToolContext) -> ConfirmationCard:
        return update_profile_card(arguments, context, now=clock.now(), ttl=ttl)

    def copies_of(arguments: Mapping[str, Any], context: ToolContext) -> tuple[HeldCopy, ...]:
        subject = resolve_subject(arguments["subject"], caller_id=context.principal.user_id)
        values = [" ".join(str(arguments["value"]).split())]
        if isinstance(arguments.get("previous_value"), str):
            values.append(str(arguments["previous_value"]))
        return tuple(HeldCopy(subject.kind, subject.id, v) for v in values if v.strip())

    return Tool(
        name=UPDATE_PROFILE,
        description=_UPDATE_PROFILE_DESCRIPTION,
        parameters=UPDATE_PROFILE_SCHEMA,
        effect="write",
        handler=handler,
        card=card,
        copies_of=copies_of,
    )


async def _current_fact(
    memory: MemoryService,
    subject: MemorySubject,
    key: str,
    context: ToolContext,
    *,
    deadline_seconds: float,
) -> ProfileFact | None:
    try:
        outcome = await memory.recall(
            query="",
            k=1,
            credentials=context.credentials,
            deadline_seconds=deadline_seconds,
            subject=subject,
            include_profile=True,
        )
    except DependencyFailed:
        return None
    return next((f for f in outcome.profile if f.key == key and f.readable), None)


def _recall_memory(memory: MemoryService, *, clock: Clock, timeout: float) -> Tool:
    async def handler(
        arguments: Mapping[str, Any], context: ToolContext
    ) -> ToolResult | ErrorValue:
        raw_subject = arguments.get("subject")
        subject = (
            resolve_subject(raw_subject, caller_id=context.principal.user_id)
            if isinstance(raw_subject, Mapping)
            else None
        )
        try:
            outcome = await memory.recall(
                query=str(arguments.get("query", "")).strip(),
                k=int(arguments.get("k", DEFAULT_RECALL_K)),
                credentials=context.credentials,
                deadline_seconds=timeout,
                subject=subject,
                include_profile=subject is not None,
            )
        except DependencyFailed as exc:
            return memory_error(exc)
        now = clock.now()
        content: dict[str, JSONValue] = {
            "memories": [memory_json(m) for m in outcome.memories if shown_now(m, now=now)],
            "mode": outcome.mode,
            "mode_reason": outcome.mode_reason,
        }
        shown = [m for m in outcome.memories if shown_now(m, now=now)]
        facts = [f for f in outcome.profile if f.readable] if subject is not None else []
        if subject is not None:
            content["profile"] = [fact_json(f) for f in facts]
        content["note"] = NEVER_A_REASON
        return ToolResult(content=content, copies=memory_copies(shown) + fact_copies(facts))

    return Tool(
        name=RECALL_MEMORY,
        description=_RECALL_MEMORY_DESCRIPTION,
        parameters=RECALL_MEMORY_SCHEMA,
        effect="read",
        handler=handler,
    )


def _recall(memory: MemoryService, *, timeout: float) -> Tool:
    async def handler(
        arguments: Mapping[str, Any], context: ToolContext
    ) -> ToolResult | ErrorValue:
        block_id = block_id_of(str(arguments["id"]))
        try:
            block = await memory.recall_block(
                block_id=block_id, credentials=context.credentials, deadline_seconds=timeout
            )
        except DependencyFailed as exc:
            return memory_error(exc)
        if not block.readable:
            return ErrorValue(
                MEMORY_SEALED,
                f"block {REFERENCE_PREFIX}{block.block_id} is encrypted at rest and this "
                "deployment holds no key to read it",
            )
        return ToolResult(
            content=block_json(block, verbatim=True),
            copies=block_copies([block], verbatim=True),
        )

    return Tool(
        name=RECALL,
        description=_RECALL_DESCRIPTION,
        parameters=RECALL_SCHEMA,
        effect="read",
        handler=handler,
    )


def _recall_search(memory: MemoryService, *, timeout: float) -> Tool:
    async def handler(
        arguments: Mapping[str, Any], context: ToolContext
    ) -> ToolResult | ErrorValue:
        try:
            blocks = await memory.search_blocks(
                query=str(arguments["query"]).strip(),
                limit=int(arguments.get("limit", 5)),
                credentials=context.credentials,
                deadline_seconds=timeout,
            )
        except DependencyFailed as exc:
            return memory_error(exc)
        readable = [b for b in blocks if b.readable]
        return ToolResult(
            content={"blocks": [block_json(b, verbatim=False) for b in readable]},
            copies=block_copies(readable, verbatim=False),
        )

    return Tool(
        name=RECALL_SEARCH,
        description=_RECALL_SEARCH_DESCRIPTION,
        parameters=RECALL_SEARCH_SCHEMA,
        effect="read",
        handler=handler,
    )


# ---------------------------------------------------------------- no memory at all


def _without_memory() -> tuple[Tool, ...]:
    def answering(content: JSONValue) -> ToolHandler:
        async def handler(
            arguments: Mapping[str, Any], context: ToolContext
        ) -> ToolResult | ErrorValue:
            return ToolResult(content=content)

        return handler

    suffix = f" ({NO_MEMORIES}: calling it changes nothing.)"
    return (
        Tool(
            name=REMEMBER,
            description=_REMEMBER_DESCRIPTION + suffix,
            parameters=REMEMBER_SCHEMA,
            effect="read",
            handler=answering({"kept": False, "note": f"{NO_MEMORIES}; nothing was kept"}),
        ),
        Tool(
            name=UPDATE_PROFILE,
            description=_UPDATE_PROFILE_DESCRIPTION + suffix,
            parameters=UPDATE_PROFILE_SCHEMA,
            effect="read",
            handler=answering({"updated": False, "note": f"{NO_MEMORIES}; nothing was changed"}),
        ),
        Tool(
            name=RECALL_MEMORY,
            description=_RECALL_MEMORY_DESCRIPTION + suffix,
            parameters=RECALL_MEMORY_SCHEMA,
            effect="read",
            handler=answering(
                {"memories": [], "note": f"{NO_MEMORIES}; there is nothing to recall"}
            ),
        ),
        Tool(
            name=RECALL,
            description=_RECALL_DESCRIPTION + suffix,
            parameters=RECALL_SCHEMA,
            effect="read",
            handler=answering(
                {"found": False, "note": f"{NO_MEMORIES}, so nothing was archived to bring back"}
            ),
        ),
        Tool(
            name=RECALL_SEARCH,
            description=_RECALL_SEARCH_DESCRIPTION + suffix,
            parameters=RECALL_SEARCH_SCHEMA,
            effect="read",
            handler=answering({"blocks": [], "note": f"{NO_MEMORIES}, so there is no archive"}),
        ),
    )
