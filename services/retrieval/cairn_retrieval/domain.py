"""What retrieval decides, in plain data and pure functions: which documents are
acceptable, what a document's chunks and identity are, how many candidates a
search draws, how two ranked lists fuse, and which mode a search is in.

Nothing here does I/O, so every decision can be tested without a database, a
vector store or a model.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cairn_libs.acl import AclPredicate, acl_keys
from cairn_libs.identity import Principal
from cairn_retrieval.chunking import ChunkBudget, EstimatedTokens, embedded_text
from cairn_retrieval.errors import (
    BadDocument,
    BadSearch,
    DenseSearchUnavailable,
    EmbedderFailed,
    RetrievalError,
    VectorStoreUnavailable,
)
from cairn_retrieval.tokens import DEFAULT_ANALYZER, Analyzer, text_length

# Who may write a corpus, delete from it and read its counts.
MANAGER_ROLES = frozenset({"ingester", "admin"})

DEFAULT_K = 4
MAX_K = 50
RRF_K = 60
MIN_CANDIDATE_POOL = 20
CANDIDATES_PER_RESULT = 5

MAX_DOCUMENTS_PER_REQUEST = 1000
MAX_TEXT_CHARS = 2_000_000
MAX_TITLE_CHARS = 1000
MAX_QUERY_CHARS = 4000
MAX_ACL_ENTRIES = 1000

# Document ids are the caller's (`_exit.2`, `guide.md#install`): any printable
# text up to this long. Chunk ids escape them (see chunk_id_for).
MAX_DOCUMENT_ID_CHARS = 512
DOCUMENT_ID_RULE = (
    f"use 1-{MAX_DOCUMENT_ID_CHARS} printable characters, not starting or ending with a space"
)
SOURCE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ACL_NAME_PATTERN = re.compile(r"[^\s\x00-\x1f]{1,200}")

_POINT_NAMESPACE = uuid.UUID("6f1c1e1a-3a4e-5c2b-9d7e-c0a1b2c3d4e5")

NO_EMBEDDER_REASON = "no embedder is configured; these results are keyword-only"
VECTOR_STORE_UNREACHABLE_REASON = "the vector store is unreachable; these results are keyword-only"
EMBEDDER_FAILED_REASON = "the embedder failed on this query; these results are keyword-only"
MODEL_MISMATCH_REASON = (
    "the vector collection holds another embedding model's vectors; these results are keyword-only"
)
NO_QUERY_TERMS_REASON = (
    "the query has no searchable words once common words are removed; these results are dense-only"
)
VECTOR_STORE_NEEDS_REPAIR_REASON = (
    "the vector collection is not the one this service wrote its vectors to (wiped, made "
    "again or replaced) and waits for `python -m cairn_retrieval reindex vectors`; these "
    "results are keyword-only"
)
KEYWORD_ASKED_REASON = "keyword-only was asked for; dense search did not run"
DENSE_ASKED_REASON = "dense-only was asked for; keyword search did not run"


class Outcome(enum.Enum):
    INGESTED = "ingested"
    UNCHANGED = "unchanged"
    REPLACED = "replaced"
    FAILED = "failed"


class SearchMode(enum.Enum):
    HYBRID = "hybrid"
    KEYWORD_ONLY = "keyword_only"
    DENSE_ONLY = "dense_only"


class DenseStatus(enum.Enum):
    """What the dense half of one search could do."""

    AVAILABLE = "available"
    NO_EMBEDDER = "no_embedder"
    VECTOR_STORE_UNREACHABLE = "vector_store_unreachable"
    EMBEDDER_FAILED = "embedder_failed"
    MODEL_MISMATCH = "model_mismatch"
    VECTOR_STORE_NEEDS_REPAIR = "vector_store_needs_repair"


# ---------------------------------------------------------------- ingest


@dataclass(frozen=True, slots=True)
class DocumentAcl:
    users: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()

    def keys(self) -> list[str]:
        return acl_keys(users=self.users, roles=self.roles, groups=self.groups)


@dataclass(frozen=True, slots=True)
class IncomingDocument:
    document_id: str
    source: str
    title: str
    text: str
    acl: DocumentAcl = DocumentAcl()
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RefusedDocument:
    """A document of a batch refused at the door (a value no store can hold), kept
    in its place so that it fails alone and the rest are ingested."""

    document_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class DocumentResult:
    document_id: str
    outcome: Outcome
    chunks: int = 0
    embedded_chunks: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class IngestProgress:
    documents_total: int
    documents_done: int
    chunks_written: int
    result: DocumentResult


@dataclass(frozen=True, slots=True)
class PreparedChunk:
    chunk_id: str
    ordinal: int
    char_start: int
    char_end: int
    text: str
    term_frequencies: Mapping[str, int]
    # What the dense half embeds: the title's prefix, then the text.
    embedded_text: str = ""

    @property
    def length(self) -> int:
        """Document length for BM25: the text's terms, repeats counted (the
        title's terms are scored, not counted in the length)."""
        return text_length(self.term_frequencies)


@dataclass(frozen=True, slots=True)
class PreparedDocument:
    """A validated document with its identity and chunks, ready to be written."""

    org_id: str
    document: IncomingDocument
    content_hash: str
    acl_keys: tuple[str, ...]
    chunks: tuple[PreparedChunk, ...]
    # How its terms and chunks were made (documents.analyzer, documents.chunking).
    analyzer: str = ""
    chunking: str = ""


def may_manage(principal: Principal) -> bool:
    return any(principal.has_role(role) for role in MANAGER_ROLES)


@dataclass(frozen=True, slots=True)
class StoredDocument:
    """A document as PostgreSQL holds it, for GetDocument."""

    org_id: str
    document_id: str
    source: str
    title: str
    text: str
    acl_keys: tuple[str, ...]
    metadata: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StoredVersion:
    """What PostgreSQL holds for one document id right now."""

    content_hash: str | None
    embedding_model: str
    vector_store: str
    analyzer: str
    chunking: str
    ready_chunks: int
    embedded_chunks: int
    pending_chunk_ids: tuple[str, ...]

    @property
    def exists(self) -> bool:
        return (
            self.content_hash is not None or self.ready_chunks > 0 or bool(self.pending_chunk_ids)
        )


@dataclass(frozen=True, slots=True)
class StoredVector:
    """A chunk's vector as PostgreSQL holds it, with what its point carries."""

    chunk_no: int
    org_id: str
    chunk_id: str
    document_id: str
    source: str
    acl: tuple[str, ...]
    vector: list[float]


@dataclass(frozen=True, slots=True)
class Published:
    """What a publish replaced: the chunk ids whose vectors are now obsolete."""

    removed_chunks: int
    removed_embedded_chunk_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DocumentView:
    """What one caller is shown of a document: its ACL only when the caller
    manages the org's corpora (an ACL names people and groups)."""

    document: StoredDocument
    acl: DocumentAcl | None


def may_read(principal: Principal, document: StoredDocument) -> bool:
    """The search rule (cairn_libs.acl), for one document of a named source."""
    predicate = AclPredicate.for_caller(principal, [document.source])
    return predicate.admits(org_id=document.org_id, source=document.source, acl=document.acl_keys)


def acl_from_keys(keys: Sequence[str]) -> DocumentAcl:
    """The stored key array (`user:`, `role:`, `group:`) back as an ACL."""
    by_kind: dict[str, list[str]] = {"user": [], "role": [], "group": []}
    for key in keys:
        kind, _, name = key.partition(":")
        if kind in by_kind:
            by_kind[kind].append(name)
    return DocumentAcl(
        users=tuple(by_kind["user"]), roles=tuple(by_kind["role"]), groups=tuple(by_kind["group"])
    )


def view_document(principal: Principal, document: StoredDocument | None) -> DocumentView | None:
    """The caller's view of a document, or None when the caller may not read it:
    the same None as for a document that does not exist (I6)."""
    if document is None or document.org_id != principal.org_id:
        return None
    if not may_read(principal, document):
        return None
    return DocumentView(
        document=document, acl=acl_from_keys(document.acl_keys) if may_manage(principal) else None
    )


def check_batch_size(count: int) -> None:
    if count > MAX_DOCUMENTS_PER_REQUEST:
        raise BadDocument(
            f"a request carries {count!r} documents; send at most "
            f"{MAX_DOCUMENTS_PER_REQUEST} per request"
        )


def is_document_id(document_id: str) -> bool:
    """Whether a document can have this id. Control and format characters (NUL,
    newlines, bidi overrides, zero-width spaces) are refused: they cannot be
    stored, or they make two different ids look the same."""
    return (
        0 < len(document_id) <= MAX_DOCUMENT_ID_CHARS
        and document_id.isprintable()
        and document_id == document_id.strip()
    )


def check_document_id(document_id: str, *, purpose: str) -> None:
    """Refuse an id no document can have, naming it; `purpose` says what the id
    was for ("delete", "read"). Saying so tells nothing about which documents
    exist (I6)."""
    if not document_id:
        raise BadDocument(f"document_id is empty; name the document to {purpose}")
    if not is_document_id(document_id):
        raise BadDocument(
            f"document_id {document_id[:MAX_DOCUMENT_ID_CHARS]!r} is not an id a document "
            f"can have; {DOCUMENT_ID_RULE}"
        )


def validate_document(doc: IncomingDocument) -> None:
    """Raise BadDocument naming the first bad field and what would be accepted."""
    if not doc.document_id:
        raise BadDocument("document_id is empty; give each document a stable id")
    if not is_document_id(doc.document_id):
        raise BadDocument(
            f"document_id {doc.document_id[:MAX_DOCUMENT_ID_CHARS]!r} is not accepted; "
            f"{DOCUMENT_ID_RULE}"
        )
    if not doc.source:
        raise BadDocument(f"document {doc.document_id!r} has no source; name its corpus")
    if not SOURCE_PATTERN.fullmatch(doc.source):
        raise BadDocument(
            f"source {doc.source!r} is not accepted; use 1-64 characters of letters, "
            "digits and . _ -, starting with a letter or digit"
        )
    if not doc.text.strip():
        raise BadDocument(f"document {doc.document_id!r} has no text; send its content")
    if len(doc.text) > MAX_TEXT_CHARS:
        raise BadDocument(
            f"document {doc.document_id!r} has {len(doc.text)!r} characters of text; "
            f"at most {MAX_TEXT_CHARS} are accepted, split it into several documents"
        )
    if "\x00" in doc.text or "\x00" in doc.title:
        raise BadDocument(
            f"document {doc.document_id!r} contains a NUL character; send text without it"
        )
    if len(doc.title) > MAX_TITLE_CHARS:
        raise BadDocument(
            f"document {doc.document_id!r} has a title of {len(doc.title)!r} characters; "
            f"at most {MAX_TITLE_CHARS} are accepted"
        )
    names = [*doc.acl.users, *doc.acl.roles, *doc.acl.groups]
    if len(names) > MAX_ACL_ENTRIES:
        raise BadDocument(
            f"document {doc.document_id!r} has {len(names)!r} ACL entries; "
            f"at most {MAX_ACL_ENTRIES} are accepted, use a group"
        )
    for name in names:
        if not ACL_NAME_PATTERN.fullmatch(name):
            raise BadDocument(
                f"ACL entry {name!r} of document {doc.document_id!r} is not accepted; "
                "use 1-200 characters without spaces or control characters"
            )


def content_hash(doc: IncomingDocument) -> str:
    """Everything that changes what is stored for a document; equal hashes mean
    re-ingesting would write nothing new."""
    canonical = json.dumps(
        {
            "source": doc.source,
            "title": doc.title,
            "text": doc.text,
            "acl": doc.acl.keys(),
            "metadata": doc.metadata,
        },
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def is_unchanged(
    *,
    stored_embedding_model: str,
    stored_vector_store: str,
    ready_chunks: int,
    embedded_chunks: int,
    embedder_model: str,
    vector_store: str,
) -> bool:
    """Whether re-ingesting a document whose content hash is the stored one
    writes nothing: always without an embedder; with one, only when every
    stored chunk already has a vector of that embedder's model, kept in the
    vector store this deployment searches."""
    if not embedder_model:
        return True
    return (
        stored_embedding_model == embedder_model
        and stored_vector_store == vector_store
        and embedded_chunks == ready_chunks
    )


def _escape_document_id(document_id: str) -> str:
    # Only '%' and '#': ids stored before '#' was allowed never hold either, so
    # their chunk ids are unchanged.
    return document_id.replace("%", "%25").replace("#", "%23")


def chunk_id_for(document_id: str, content_hash: str, ordinal: int) -> str:
    """`<document id, '%' and '#' escaped>#<content version>-<ordinal>`. The
    content version means a replacement's chunks never collide with the ones
    they replace, so the swap can be one transaction; the escape means the first
    '#' always ends the document id."""
    return f"{_escape_document_id(document_id)}#{content_hash[:12]}-{ordinal:05d}"


def document_id_of_chunk(chunk_id: str) -> str:
    """The document id a chunk id was made from (the inverse of chunk_id_for)."""
    escaped, _, _ = chunk_id.partition("#")
    return escaped.replace("%23", "#").replace("%25", "%")


def point_id(org_id: str, chunk_id: str) -> str:
    """The Qdrant point id of a chunk: stable, and distinct across orgs."""
    return str(uuid.uuid5(_POINT_NAMESPACE, f"{org_id}\x1f{chunk_id}"))


DEFAULT_BUDGET = ChunkBudget(EstimatedTokens())


def prepare_document(
    org_id: str,
    doc: IncomingDocument,
    *,
    analyzer: Analyzer = DEFAULT_ANALYZER,
    budget: ChunkBudget = DEFAULT_BUDGET,
) -> PreparedDocument:
    """Validate, chunk to the embedder's window and analyze: the chunks' ids carry
    the content and how it was indexed, so re-indexing the same text with another
    analyzer or chunking writes new chunks beside the served ones."""
    validate_document(doc)
    digest = content_hash(doc)
    version = hashlib.sha256(f"{digest}\x1f{analyzer.name}\x1f{budget.name}".encode()).hexdigest()
    title_prefix, _ = budget.title_prefix(doc.title)
    chunks = tuple(
        PreparedChunk(
            chunk_id=chunk_id_for(doc.document_id, version, span.ordinal),
            ordinal=span.ordinal,
            char_start=span.char_start,
            char_end=span.char_end,
            text=doc.text[span.char_start : span.char_end],
            term_frequencies=dict(
                analyzer.term_frequencies(
                    doc.text[span.char_start : span.char_end], title=doc.title
                )
            ),
            embedded_text=embedded_text(title_prefix, doc.text[span.char_start : span.char_end]),
        )
        for span in budget.spans(doc.text, title=doc.title)
    )
    return PreparedDocument(
        org_id=org_id,
        document=doc,
        content_hash=digest,
        acl_keys=tuple(doc.acl.keys()),
        chunks=chunks,
        analyzer=analyzer.name,
        chunking=budget.name,
    )


# ---------------------------------------------------------------- search


@dataclass(frozen=True, slots=True)
class RankedHit:
    chunk_id: str
    score: float


@dataclass(frozen=True, slots=True)
class FusedHit:
    chunk_id: str
    fused_score: float
    keyword_rank: int
    dense_rank: int
    bm25_score: float
    dense_score: float


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    chunk_id: str
    document_id: str
    source: str
    title: str
    char_start: int
    char_end: int
    text: str


@dataclass(frozen=True, slots=True)
class SearchHit:
    chunk: ChunkRecord
    bm25_score: float
    dense_score: float
    fused_score: float
    keyword_rank: int
    dense_rank: int


@dataclass(frozen=True, slots=True)
class SearchOutcome:
    results: tuple[SearchHit, ...]
    mode: SearchMode
    mode_reason: str


def resolve_k(k: int) -> int:
    if k == 0:
        return DEFAULT_K
    if not 1 <= k <= MAX_K:
        raise BadSearch(
            f"k={k!r} is out of range; ask for 1 to {MAX_K} results, or 0 for {DEFAULT_K}"
        )
    return k


def validate_query(query: str) -> str:
    if not query.strip():
        raise BadSearch("query is empty; send the words to search for")
    if len(query) > MAX_QUERY_CHARS:
        raise BadSearch(
            f"query has {len(query)!r} characters; at most {MAX_QUERY_CHARS} are accepted"
        )
    return query


def candidate_pool(k: int) -> int:
    """How many candidates each list contributes to fusion."""
    return max(k * CANDIDATES_PER_RESULT, MIN_CANDIDATE_POOL)


def rank(hits: Iterable[tuple[str, float]]) -> list[RankedHit]:
    """Best first; equal scores ordered by chunk id so results are reproducible."""
    return [RankedHit(cid, score) for cid, score in sorted(hits, key=lambda h: (-h[1], h[0]))]


def fuse_rrf(
    keyword: Sequence[RankedHit],
    dense: Sequence[RankedHit],
    *,
    limit: int,
    rrf_k: int = RRF_K,
) -> list[FusedHit]:
    """Reciprocal Rank Fusion: each list gives 1/(rrf_k + rank), ranks 1-based."""
    keyword_at = {hit.chunk_id: (i + 1, hit.score) for i, hit in enumerate(keyword)}
    dense_at = {hit.chunk_id: (i + 1, hit.score) for i, hit in enumerate(dense)}
    fused: list[FusedHit] = []
    for chunk_id in keyword_at.keys() | dense_at.keys():
        k_rank, k_score = keyword_at.get(chunk_id, (0, 0.0))
        d_rank, d_score = dense_at.get(chunk_id, (0, 0.0))
        # Summed in a fixed order (keyword, then dense) so equal inputs give
        # bit-equal floats.
        score = 0.0
        if k_rank:
            score += 1.0 / (rrf_k + k_rank)
        if d_rank:
            score += 1.0 / (rrf_k + d_rank)
        fused.append(FusedHit(chunk_id, score, k_rank, d_rank, k_score, d_score))
    fused.sort(key=lambda h: (-h.fused_score, h.chunk_id))
    return fused[:limit]


def decide_mode(
    *,
    dense: DenseStatus,
    has_query_terms: bool,
    requested: SearchMode = SearchMode.HYBRID,
) -> tuple[SearchMode, str]:
    """The mode a search ran in, and the reason when it is not HYBRID (I11).
    A DENSE_ONLY request whose dense half cannot run never gets here
    (`refuse_dense_only`)."""
    if requested is SearchMode.KEYWORD_ONLY:
        return SearchMode.KEYWORD_ONLY, KEYWORD_ASKED_REASON
    if requested is SearchMode.DENSE_ONLY:
        return SearchMode.DENSE_ONLY, DENSE_ASKED_REASON
    if dense is DenseStatus.NO_EMBEDDER:
        return SearchMode.KEYWORD_ONLY, NO_EMBEDDER_REASON
    if dense is DenseStatus.VECTOR_STORE_UNREACHABLE:
        return SearchMode.KEYWORD_ONLY, VECTOR_STORE_UNREACHABLE_REASON
    if dense is DenseStatus.EMBEDDER_FAILED:
        return SearchMode.KEYWORD_ONLY, EMBEDDER_FAILED_REASON
    if dense is DenseStatus.MODEL_MISMATCH:
        return SearchMode.KEYWORD_ONLY, MODEL_MISMATCH_REASON
    if dense is DenseStatus.VECTOR_STORE_NEEDS_REPAIR:
        return SearchMode.KEYWORD_ONLY, VECTOR_STORE_NEEDS_REPAIR_REASON
    if not has_query_terms:
        return SearchMode.DENSE_ONLY, NO_QUERY_TERMS_REASON
    return SearchMode.HYBRID, ""


def refuse_dense_only(dense: DenseStatus) -> RetrievalError | None:
    """Why a DENSE_ONLY search cannot be answered, or None when it can. Keyword
    results are never passed off as the dense-only answer that was asked for:
    a deployment that cannot embed is FAILED_PRECONDITION, a dense half that
    failed this time is UNAVAILABLE (worth a retry)."""
    if dense is DenseStatus.NO_EMBEDDER:
        return DenseSearchUnavailable(
            "dense-only search needs an embedder and none is configured; ask for "
            "SEARCH_MODE_KEYWORD_ONLY or SEARCH_MODE_HYBRID"
        )
    if dense is DenseStatus.MODEL_MISMATCH:
        return DenseSearchUnavailable(
            "dense-only search cannot run: " + MODEL_MISMATCH_REASON.split(";")[0]
        )
    if dense is DenseStatus.VECTOR_STORE_NEEDS_REPAIR:
        return DenseSearchUnavailable(
            "dense-only search cannot run: " + VECTOR_STORE_NEEDS_REPAIR_REASON.split(";")[0]
        )
    if dense is DenseStatus.VECTOR_STORE_UNREACHABLE:
        return VectorStoreUnavailable(
            "dense-only search cannot run: the vector store is unreachable; retry shortly"
        )
    if dense is DenseStatus.EMBEDDER_FAILED:
        return EmbedderFailed(
            "dense-only search cannot run: the embedder failed on this query; retry shortly"
        )
    return None


def assemble_results(
    fused: Sequence[FusedHit], records: Mapping[str, ChunkRecord]
) -> tuple[SearchHit, ...]:
    """Fused hits with their chunks; a hit whose chunk is gone is dropped."""
    return tuple(
        SearchHit(
            chunk=records[hit.chunk_id],
            bm25_score=hit.bm25_score,
            dense_score=hit.dense_score,
            fused_score=hit.fused_score,
            keyword_rank=hit.keyword_rank,
            dense_rank=hit.dense_rank,
        )
        for hit in fused
        if hit.chunk_id in records
    )


# ---------------------------------------------------------------- stats


@dataclass(frozen=True, slots=True)
class SourceCounts:
    source: str
    documents: int
    chunks: int
    embedded_chunks: int


@dataclass(frozen=True, slots=True)
class CorpusStats:
    sources: tuple[SourceCounts, ...]
    embedder: str

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.sources)

    @property
    def chunks(self) -> int:
        return sum(s.chunks for s in self.sources)

    @property
    def embedded_chunks(self) -> int:
        return sum(s.embedded_chunks for s in self.sources)
