"""What the memory service holds and the rules that decide what may be kept.

Plain dataclasses and pure functions: no I/O, no proto, no clock reads. Every
decision a request needs (is this one sentence, who wrote it, when does it
expire, which recall mode answers, which block an id names) is made here from
values, so each rule is tested without a database.
"""

from __future__ import annotations

import enum
import hashlib
import re
import unicodedata
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from cairn_libs import subject_access
from cairn_libs.identity import CallIdentity
from cairn_libs.page_token import UnreadablePageToken, decode_page_token, encode_page_token
from cairn_memory.errors import NotOneSentence, ProfileValueChanged, RefusedInput, SecretInText
from cairn_memory.screening import secret_kind, sentence_count

MAX_TEXT_CHARS: Final = 300
MAX_SOURCE_REF_CHARS: Final = 1024
MAX_SUPERSEDES: Final = 20
MAX_TAGS: Final = 20
MAX_TAG_CHARS: Final = 64
MAX_SUBJECT_ID_CHARS: Final = 256
DEFAULT_IMPORTANCE: Final = 2
DEFAULT_RECALL_K: Final = 5
MAX_RECALL_K: Final = 50
MAX_QUERY_CHARS: Final = 2000
MAX_FACT_VALUE_CHARS: Final = 300
DEFAULT_BLOCK_LIMIT: Final = 5
MAX_BLOCK_LIMIT: Final = 20
MAX_BLOCK_LABEL_CHARS: Final = 200
MAX_BLOCK_ROLE_CHARS: Final = 32
MAX_BLOCK_SUBJECTS: Final = 32
MAX_BLOCK_CONTENT_BYTES: Final = 512 * 1024
MAX_CONVERSATION_ID_CHARS: Final = 256
DEFAULT_TTL: Final = timedelta(days=90)
DEFAULT_HELD_PAGE: Final = 100
MAX_HELD_PAGE: Final = 1000
# What a refusal shows of a caller's value: enough to recognise it, never a wall of text.
MAX_ECHO_CHARS: Final = 64
# The instants google.protobuf.Timestamp can carry; PostgreSQL holds a wider range.
EARLIEST: Final = datetime(1, 1, 1, tzinfo=UTC)
LATEST: Final = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)

_FACT_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")
_BLOCK_ID = re.compile(r"[rR]?([0-9]{1,18})", re.ASCII)


class SubjectKind(enum.Enum):
    WORKSPACE = "WORKSPACE"
    USER = "USER"
    CANDIDATE = "CANDIDATE"
    EMPLOYEE = "EMPLOYEE"
    CUSTOMER = "CUSTOMER"

    @property
    def is_person(self) -> bool:
        return self is not SubjectKind.WORKSPACE


class ClaimType(enum.Enum):
    UNKNOWN = "UNKNOWN"
    USER_STATEMENT = "USER_STATEMENT"
    INFERENCE = "INFERENCE"


class AuthorKind(enum.Enum):
    MODEL = "MODEL"
    PERSON = "PERSON"


class MemoryState(enum.Enum):
    ACTIVE = "ACTIVE"
    SUPERSEDED = "SUPERSEDED"
    EXPIRED = "EXPIRED"
    ERASED = "ERASED"


class RecallMode(enum.Enum):
    SEMANTIC = "SEMANTIC"
    NEWEST_FIRST = "NEWEST_FIRST"


@dataclass(frozen=True, slots=True)
class Subject:
    """Whom (or what) a memory is about; `id` is empty only for WORKSPACE."""

    kind: SubjectKind
    id: str = ""


def may_handle_subject_records(subject: Subject, *, user_id: str, roles: tuple[str, ...]) -> bool:
    """Who may list (Held) or erase (Forget) everything about a subject: an org admin
    or privacy officer, or the person themselves for their own USER subject. Anyone
    else would learn what the company holds about a colleague or a candidate. The
    rule lives in libs, because the orchestrator's ForgetCopies applies it too."""
    return subject_access.may_handle_subject_records(
        subject.kind.value, subject.id, user_id=user_id, roles=roles
    )


@dataclass(frozen=True, slots=True)
class Author:
    """Who wrote something, as the verified call says: never from a request body."""

    kind: AuthorKind
    id: str
    run_id: str = ""
    on_behalf_of: str = ""


@dataclass(frozen=True, slots=True)
class RememberDraft:
    """A Remember request as the caller sent it, before any rule is applied."""

    text: str
    subject_kind: SubjectKind | None
    subject_id: str
    tags: Sequence[str] = ()
    importance: int = 0
    claim_type: ClaimType | None = None
    event_at: datetime | None = None
    valid_from: datetime | None = None
    valid_until: datetime | None = None
    source_ref: str = ""
    supersedes: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class NewMemory:
    """A memory that passed every rule and is ready to be stored."""

    memory_id: str
    text: str
    subject: Subject
    tags: tuple[str, ...]
    importance: int
    claim_type: ClaimType
    event_at: datetime | None
    valid_from: datetime | None
    valid_until: datetime | None
    source_ref: str
    supersedes: tuple[str, ...]
    author: Author
    created_at: datetime
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Memory:
    """A memory as held, with its provenance. `text` is empty once erased, and
    also when it is sealed and this deployment holds no key (`readable` False)."""

    memory_id: str
    subject: Subject
    text: str
    tags: tuple[str, ...]
    importance: int
    claim_type: ClaimType
    event_at: datetime | None
    valid_from: datetime | None
    valid_until: datetime | None
    author: Author
    created_at: datetime
    expires_at: datetime
    superseded_by: str
    source_ref: str
    state: MemoryState
    readable: bool = True
    score: float = 0.0


@dataclass(frozen=True, slots=True)
class FactVersion:
    value: str
    author: Author
    created_at: datetime
    expires_at: datetime
    readable: bool = True


@dataclass(frozen=True, slots=True)
class ProfileFact:
    """A stable keyed fact: its current value (None once expired) and earlier ones, newest first."""

    subject: Subject
    fact_key: str
    current: FactVersion | None
    history: tuple[FactVersion, ...] = ()


@dataclass(frozen=True, slots=True)
class ProfileUpdate:
    subject: Subject
    fact_key: str
    value: str
    previous_value: str | None
    author: Author
    created_at: datetime
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Erasure:
    """The record that a subject's memories, facts and archived blocks were erased.

    `copies_erased` is True once every other service's copies are gone too (the
    orchestrator's run state, steps and confirmations); False means the erasure here
    is done and kept, and a Forget again finishes the rest.
    """

    subject: Subject
    erased_by: str
    erased_at: datetime
    memories_erased: int
    facts_erased: int
    blocks_erased: int = 0
    copies_erased: bool = False


@dataclass(frozen=True, slots=True)
class HeldCursor:
    """Where a page of Held ended: the last memory on it (pages run newest first).
    `scope` names the org and subject the page belongs to (see `held_scope`)."""

    created_at: datetime
    memory_id: str
    scope: str = ""


@dataclass(frozen=True, slots=True)
class HeldQuery:
    """One page of subject access: memories after `after`; profile and erasures
    only on the first page (after is None)."""

    subject: Subject
    page_size: int
    after: HeldCursor | None = None
    scope: str = ""


@dataclass(frozen=True, slots=True)
class HeldAbout:
    """Everything held about one subject (subject access), one page of memories at a time."""

    memories: tuple[Memory, ...]
    profile: tuple[ProfileFact, ...]
    erasures: tuple[Erasure, ...]
    next_page: HeldCursor | None = None


@dataclass(frozen=True, slots=True)
class RecallQuery:
    query: str
    subject: Subject | None
    k: int
    include_profile: bool


@dataclass(frozen=True, slots=True)
class Recalled:
    memories: tuple[Memory, ...]
    mode: RecallMode
    mode_reason: str
    profile: tuple[ProfileFact, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockDraft:
    label: str
    role: str
    content: str
    conversation_id: str
    # Whom the block is about; Forget of any of them erases it (I9).
    subjects: tuple[Subject, ...] = ()


@dataclass(frozen=True, slots=True)
class Block:
    number: int
    label: str
    role: str
    content: str
    conversation_id: str
    created_at: datetime
    readable: bool = True
    subjects: tuple[Subject, ...] = ()
    # Forget erased it: content and label are blank, only the tombstone remains.
    erased: bool = False

    @property
    def block_id(self) -> str:
        return format_block_id(self.number)


@dataclass(frozen=True, slots=True)
class BlockSearch:
    query: str
    limit: int
    conversation_id: str | None


@dataclass(frozen=True, slots=True)
class PurgeCounts:
    memories: int
    fact_versions: int
    blocks: int = 0


# --- who wrote it ----------------------------------------------------------------


def author_of(identity: CallIdentity) -> Author:
    """The author is the verified call: an acting service with a run makes it a
    model's memory in that run; a person calling directly makes it theirs (I9)."""
    actor = identity.actor
    if actor is not None:
        return Author(
            kind=AuthorKind.MODEL,
            id=actor.agent or actor.service,
            run_id=actor.run_id,
            on_behalf_of=identity.principal.user_id,
        )
    return Author(kind=AuthorKind.PERSON, id=identity.principal.user_id)


# --- what may be kept -------------------------------------------------------------


def subject_from(
    kind: SubjectKind | None, subject_id: str, *, field_name: str = "subject"
) -> Subject:
    """A subject names its kind; a person kind names whom, refused at the door otherwise."""
    if kind is None:
        raise RefusedInput(
            f"{field_name}.kind is required: one of {', '.join(k.value for k in SubjectKind)}"
        )
    refuse_unstorable(subject_id, field_name=f"{field_name}.id")
    subject_id = subject_id.strip()
    refuse_secret(subject_id, field_name=f"{field_name}.id")
    if kind.is_person and not subject_id:
        raise RefusedInput(
            f"{field_name}.id is required for a {kind.value} subject: "
            "a personal memory must name whom it is about"
        )
    if not kind.is_person and subject_id:
        raise RefusedInput(
            f"{field_name}.id must be empty for a WORKSPACE subject, got {shown(subject_id)}"
        )
    if len(subject_id) > MAX_SUBJECT_ID_CHARS:
        raise RefusedInput(
            f"{field_name}.id is {len(subject_id)} characters; at most {MAX_SUBJECT_ID_CHARS}"
        )
    return Subject(kind=kind, id=subject_id)


def refuse_secret(value: str, *, field_name: str) -> None:
    """Refuse `value` when it looks like it holds a secret, naming only the kind."""
    kind = secret_kind(value)
    if kind is not None:
        raise SecretInText(
            f"{field_name} looks like it contains {kind}; secrets are never kept in memory. "
            "Remove it and send the text again"
        )


def refuse_unstorable(value: str, *, field_name: str) -> None:
    """U+0000 is the one character PostgreSQL text cannot hold: refused here, naming
    the field, rather than failing in the database as if it were down."""
    if "\x00" in value:
        raise RefusedInput(
            f"{field_name} contains the character U+0000 (NUL), which cannot be stored; "
            "remove it and send the request again"
        )


def shown(value: str) -> str:
    """A caller's value as a refusal quotes it: repr'd and cut short, and never at all
    when it looks like a secret (a mistyped field can still hold one)."""
    kind = secret_kind(value)
    if kind is not None:
        return f"(a value that looks like it contains {kind}, not repeated here)"
    if len(value) > MAX_ECHO_CHARS:
        return f"{value[:MAX_ECHO_CHARS]!r}... ({len(value)} characters)"
    return repr(value)


def refuse_secrets_in_block(*, label: str, role: str, content: str, conversation_id: str) -> None:
    """What Archive refuses before anything else: text PostgreSQL cannot store, and
    secrets in the block's label or its verbatim content."""
    for name, value in (
        ("label", label),
        ("role", role),
        ("content", content),
        ("conversation_id", conversation_id),
    ):
        refuse_unstorable(value, field_name=name)
    refuse_secret(label, field_name="label")
    refuse_secret(content, field_name="content")


def checked_sentence(text: str) -> str:
    """The memory text, stripped, if it is one sentence of at most 300 characters."""
    refuse_unstorable(text, field_name="text")
    text = text.strip()
    if not text:
        raise NotOneSentence("text is empty; a memory is one sentence")
    if len(text) > MAX_TEXT_CHARS:
        raise NotOneSentence(
            f"text is {len(text)} characters; a memory is one sentence of at most "
            f"{MAX_TEXT_CHARS} characters"
        )
    if "\n" in text or "\r" in text:
        raise NotOneSentence("text spans several lines; a memory is one sentence on one line")
    sentences = sentence_count(text)
    if sentences > 1:
        raise NotOneSentence(
            f"text holds {sentences} sentences; a memory is one sentence, so send each as its own memory"
        )
    return text


def _checked_tags(tags: Sequence[str]) -> tuple[str, ...]:
    kept: list[str] = []
    for index, raw in enumerate(tags):
        refuse_unstorable(raw, field_name=f"tags[{index}]")
        tag = raw.strip()
        if not tag:
            raise RefusedInput(f"tags[{index}] is empty; a tag is 1-{MAX_TAG_CHARS} characters")
        if len(tag) > MAX_TAG_CHARS:
            raise RefusedInput(
                f"tags[{index}] is {len(tag)} characters; a tag is 1-{MAX_TAG_CHARS} characters"
            )
        refuse_secret(tag, field_name=f"tags[{index}]")
        if tag not in kept:
            kept.append(tag)
    if len(kept) > MAX_TAGS:
        raise RefusedInput(f"{len(kept)} tags given; at most {MAX_TAGS}")
    return tuple(kept)


def _checked_supersedes(ids: Sequence[str]) -> tuple[str, ...]:
    if len(ids) > MAX_SUPERSEDES:
        raise RefusedInput(
            f"supersedes names {len(ids)} memories; at most {MAX_SUPERSEDES} per call"
        )
    kept: list[str] = []
    for index, raw in enumerate(ids):
        try:
            memory_id = str(uuid.UUID(raw.strip()))
        except ValueError:
            raise RefusedInput(
                f"supersedes[{index}] = {shown(raw)} is not a memory id "
                "(a UUID as Remember returns)"
            ) from None
        if memory_id not in kept:
            kept.append(memory_id)
    return tuple(kept)


def new_memory(
    draft: RememberDraft, *, author: Author, now: datetime, ttl: timedelta, memory_id: str
) -> NewMemory:
    """Apply every Remember rule; raise the first refusal, naming the field."""
    subject = subject_from(draft.subject_kind, draft.subject_id)
    text = checked_sentence(draft.text)
    refuse_secret(text, field_name="text")
    if draft.importance == 0:
        importance = DEFAULT_IMPORTANCE
    elif 1 <= draft.importance <= 5:
        importance = draft.importance
    else:
        raise RefusedInput(
            f"importance {draft.importance!r} is out of range; use 1-5 (0 means the default of 2)"
        )
    for name, moment in (
        ("event_at", draft.event_at),
        ("valid_from", draft.valid_from),
        ("valid_until", draft.valid_until),
    ):
        if moment is not None:
            checked_moment(moment, field_name=name)
    if (
        draft.valid_from is not None
        and draft.valid_until is not None
        and draft.valid_until <= draft.valid_from
    ):
        raise RefusedInput(
            f"valid_until {draft.valid_until.isoformat()!r} is not after valid_from "
            f"{draft.valid_from.isoformat()!r}; a validity window must end after it starts"
        )
    refuse_unstorable(draft.source_ref, field_name="source_ref")
    source_ref = draft.source_ref.strip()
    if len(source_ref) > MAX_SOURCE_REF_CHARS:
        raise RefusedInput(
            f"source_ref is {len(source_ref)} characters; at most {MAX_SOURCE_REF_CHARS}"
        )
    if source_ref:
        refuse_secret(source_ref, field_name="source_ref")
    return NewMemory(
        memory_id=memory_id,
        text=text,
        subject=subject,
        tags=_checked_tags(draft.tags),
        importance=importance,
        claim_type=draft.claim_type or ClaimType.UNKNOWN,
        event_at=draft.event_at,
        valid_from=draft.valid_from,
        valid_until=draft.valid_until,
        source_ref=source_ref,
        supersedes=_checked_supersedes(draft.supersedes),
        author=author,
        created_at=now,
        expires_at=now + ttl,
    )


def checked_moment(moment: datetime, *, field_name: str) -> datetime:
    """`moment` if it is a time-zone-aware instant within what a Timestamp carries."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise RefusedInput(
            f"{field_name} {moment.isoformat()!r} has no time zone; give one explicitly"
        )
    try:
        in_utc = moment.astimezone(UTC)
    except OverflowError:
        in_utc = None
    if in_utc is None or not EARLIEST <= in_utc <= LATEST:
        raise RefusedInput(
            f"{field_name} {moment.isoformat()!r} is out of range; give a time between "
            "0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z"
        )
    return in_utc


def normalised_text(text: str) -> str:
    """The form two texts are compared in for "the same text about the same subject":
    Unicode-normalised, whitespace collapsed, case folded."""
    return " ".join(unicodedata.normalize("NFKC", text).split()).casefold()


def effective_state(stored: MemoryState, *, expires_at: datetime, now: datetime) -> MemoryState:
    """A stored ACTIVE memory past its expiry reads as EXPIRED until the purge removes it."""
    if stored is MemoryState.ACTIVE and expires_at <= now:
        return MemoryState.EXPIRED
    return stored


# --- subject access ---------------------------------------------------------------


def held_scope(*, org_id: str, subject: Subject) -> str:
    """What a page token is bound to: one org's one subject. Not a secret (the cursor
    only positions a listing the caller may read anyway), but a token of another
    listing is refused rather than silently paging the wrong one."""
    named = "\x1f".join((org_id, subject.kind.value, subject.id)).encode()
    return hashlib.sha256(named).hexdigest()[:16]


_HELD_TOKEN_FIELDS: Final = ("c", "m", "s")


def format_page_token(cursor: HeldCursor) -> str:
    return encode_page_token(
        {"c": cursor.created_at.isoformat(), "m": cursor.memory_id, "s": cursor.scope}
    )


def parse_page_token(token: str) -> HeldCursor:
    """The cursor a next_page_token names; refused when it is not one Held gave out."""
    refusal = RefusedInput(
        f"page_token {shown(token)} is not a token Held gave out; pass next_page_token "
        "from the previous page unchanged, or leave it empty for the first page"
    )
    try:
        fields = decode_page_token(token, fields=_HELD_TOKEN_FIELDS)
        created_at = datetime.fromisoformat(fields["c"])
        memory_id = str(uuid.UUID(fields["m"]))
        scope = fields["s"]
        checked_moment(created_at, field_name="page_token")
    except (UnreadablePageToken, ValueError, OverflowError, RefusedInput):
        raise refusal from None
    return HeldCursor(created_at=created_at, memory_id=memory_id, scope=scope)


def held_query(subject: Subject, *, page_size: int, page_token: str, org_id: str) -> HeldQuery:
    if page_size < 0 or page_size > MAX_HELD_PAGE:
        raise RefusedInput(
            f"page_size {page_size!r} is out of range; use 1-{MAX_HELD_PAGE} "
            f"(0 means the default of {DEFAULT_HELD_PAGE})"
        )
    scope = held_scope(org_id=org_id, subject=subject)
    token = page_token.strip()
    after = parse_page_token(token) if token else None
    if after is not None and after.scope != scope:
        raise RefusedInput(
            "page_token was given out for another subject's listing; pass the "
            "next_page_token of this subject's previous page, or leave it empty for the first page"
        )
    return HeldQuery(
        subject=subject, page_size=page_size or DEFAULT_HELD_PAGE, after=after, scope=scope
    )


# --- profile facts ----------------------------------------------------------------


def profile_update(
    *,
    subject: Subject,
    fact_key: str,
    value: str,
    previous_value: str | None,
    author: Author,
    now: datetime,
    ttl: timedelta,
) -> ProfileUpdate:
    for name, given in (("fact_key", fact_key), ("value", value)):
        refuse_unstorable(given, field_name=name)
        refuse_secret(given, field_name=name)
    if previous_value is not None:
        refuse_unstorable(previous_value, field_name="previous_value")
    key = fact_key.strip()
    if not _FACT_KEY.fullmatch(key):
        raise RefusedInput(
            f"fact_key {shown(fact_key)} is not a fact key; use lower-case letters, digits and "
            "underscores, starting with a letter, at most 64 characters (e.g. 'coffee_preference')"
        )
    value = value.strip()
    if not value:
        raise RefusedInput("value is empty; a profile fact needs a value")
    if len(value) > MAX_FACT_VALUE_CHARS:
        raise RefusedInput(f"value is {len(value)} characters; at most {MAX_FACT_VALUE_CHARS}")
    if "\n" in value or "\r" in value:
        raise RefusedInput("value spans several lines; a profile fact is one line")
    return ProfileUpdate(
        subject=subject,
        fact_key=key,
        value=value,
        previous_value=previous_value.strip() if previous_value is not None else None,
        author=author,
        created_at=now,
        expires_at=now + ttl,
    )


# --- recall -----------------------------------------------------------------------

NO_EMBEDDER_REASON: Final = "no embedder is configured; memories are listed newest first"
NO_QUERY_REASON: Final = "no query was given; memories are listed newest first"
SEMANTIC_REASON: Final = "memories are ranked by similarity of meaning to the query"


def recall_query(
    *, query: str, subject: Subject | None, k: int, include_profile: bool
) -> RecallQuery:
    if k < 0 or k > MAX_RECALL_K:
        raise RefusedInput(
            f"k {k!r} is out of range; use 1-{MAX_RECALL_K} (0 means the default of {DEFAULT_RECALL_K})"
        )
    if len(query) > MAX_QUERY_CHARS:
        raise RefusedInput(f"query is {len(query)} characters; at most {MAX_QUERY_CHARS}")
    refuse_unstorable(query, field_name="query")
    if include_profile and subject is None:
        raise RefusedInput(
            "include_profile needs a subject: a profile belongs to one subject, so name it"
        )
    return RecallQuery(
        query=query.strip(),
        subject=subject,
        k=k or DEFAULT_RECALL_K,
        include_profile=include_profile,
    )


def recall_mode(*, has_embedder: bool, query: str) -> tuple[RecallMode, str]:
    """SEMANTIC needs both an embedder and a query; otherwise newest first, saying why (I11)."""
    if not has_embedder:
        return RecallMode.NEWEST_FIRST, NO_EMBEDDER_REASON
    if not query.strip():
        return RecallMode.NEWEST_FIRST, NO_QUERY_REASON
    return RecallMode.SEMANTIC, SEMANTIC_REASON


# --- the archive ------------------------------------------------------------------


def format_block_id(number: int) -> str:
    return f"r{number}"


def parse_block_id(raw: str) -> int | None:
    """The block number `raw` names ("r7", "R7 ", "7" all name 7), or None."""
    match = _BLOCK_ID.fullmatch(raw.strip())
    if match is None:
        return None
    number = int(match.group(1))
    return number if number >= 1 else None


def block_number(raw: str) -> int:
    number = parse_block_id(raw)
    if number is None:
        raise RefusedInput(f"block_id {shown(raw)} is not a block id; use the form r<N>, e.g. 'r7'")
    return number


def block_draft(
    *,
    label: str,
    role: str,
    content: str,
    conversation_id: str,
    subjects: Sequence[Subject] = (),
    archived_by: str,
) -> BlockDraft:
    """A block to archive. It is always about the person archiving it (their own
    words and the answers they were given), and about every subject they name."""
    label = label.strip()
    role = role.strip()
    conversation_id = conversation_id.strip()
    if not conversation_id:
        raise RefusedInput("conversation_id is required: a block belongs to one conversation")
    if len(conversation_id) > MAX_CONVERSATION_ID_CHARS:
        raise RefusedInput(
            f"conversation_id is {len(conversation_id)} characters; at most {MAX_CONVERSATION_ID_CHARS}"
        )
    if not label:
        raise RefusedInput("label is required: a short title the block can be found by")
    if len(label) > MAX_BLOCK_LABEL_CHARS:
        raise RefusedInput(f"label is {len(label)} characters; at most {MAX_BLOCK_LABEL_CHARS}")
    if len(role) > MAX_BLOCK_ROLE_CHARS:
        raise RefusedInput(f"role {shown(role)} is longer than {MAX_BLOCK_ROLE_CHARS} characters")
    if not content.strip():
        raise RefusedInput("content is empty; archive the block's verbatim text")
    size = len(content.encode())
    if size > MAX_BLOCK_CONTENT_BYTES:
        raise RefusedInput(f"content is {size} bytes; at most {MAX_BLOCK_CONTENT_BYTES}")
    if len(subjects) > MAX_BLOCK_SUBJECTS:
        raise RefusedInput(
            f"subjects names {len(subjects)} subjects; at most {MAX_BLOCK_SUBJECTS} per block"
        )
    about = dict.fromkeys((Subject(SubjectKind.USER, archived_by), *subjects))
    return BlockDraft(
        label=label,
        role=role,
        content=content,
        conversation_id=conversation_id,
        subjects=tuple(about),
    )


def block_search(*, query: str, limit: int, conversation_id: str) -> BlockSearch:
    if limit < 0 or limit > MAX_BLOCK_LIMIT:
        raise RefusedInput(
            f"limit {limit!r} is out of range; use 1-{MAX_BLOCK_LIMIT} (0 means the default of {DEFAULT_BLOCK_LIMIT})"
        )
    refuse_unstorable(query, field_name="query")
    refuse_unstorable(conversation_id, field_name="conversation_id")
    query = query.strip()
    if not query:
        raise RefusedInput("query is empty; give the words to search the archive for")
    if len(query) > MAX_QUERY_CHARS:
        raise RefusedInput(f"query is {len(query)} characters; at most {MAX_QUERY_CHARS}")
    return BlockSearch(
        query=query,
        limit=limit or DEFAULT_BLOCK_LIMIT,
        conversation_id=conversation_id.strip() or None,
    )


def check_previous_value(update: ProfileUpdate, *, live: bool, current_value: str | None) -> None:
    """Whether an update naming the value it replaces may go ahead; a decision, so
    it lives here and the store only reads the current value under its row lock."""
    expected = update.previous_value
    key = update.fact_key
    if not live:
        if expected:
            raise ProfileValueChanged(
                f"previous_value {shown(expected)} does not match: {key!r} has no current value; "
                "send previous_value '' (or leave it unset) to set it"
            )
        return
    if current_value is None:
        raise ProfileValueChanged(
            f"the current value of {key!r} is encrypted and this deployment holds no key, "
            "so previous_value cannot be compared; leave previous_value unset to replace it"
        )
    if current_value != expected:
        raise ProfileValueChanged(
            f"previous_value {shown(expected or '')} is not the current value of {key!r}; "
            "read the profile again (Held or Recall with include_profile) and retry"
        )
