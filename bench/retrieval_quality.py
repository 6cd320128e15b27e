"""Retrieval quality on held-out known items, through cairn's own API: is cairn's
keyword search at least a plain library BM25, and its hybrid ahead of a plain
RRF of that BM25 with the same embedder?

Corpora (Debian packages, installed by `make bench-data`), neither used to tune
cairn: the reStructuredText sources of the Python 3.11 documentation
(python3.11-doc) and the PostgreSQL 15 HTML documentation (postgresql-doc-15),
one document per file, whole.

Queries are made mechanically and held out of the text:
- a document is taken when it is at most MAX_DOCUMENT_CHARS long, in the order of
  sha1(document id), until the size budget (characters per corpus) is spent;
- a candidate query is a section heading (not the document's title) of at least
  two words, with reST roles and section numbers removed, that heads a section
  in exactly one taken document;
- each document gives at most QUERIES_PER_DOCUMENT queries, its candidates
  with the lowest sha1(document id, heading); all are then taken in that sha1
  order up to the query budget;
- the heading lines of the queries are removed from the text that is ingested,
  so a query's words must be found in its section, not copied from it.
The one relevant item is the document. Results are chunks (or passages); a
document's rank is the rank of its first chunk among the distinct documents
returned. nDCG@10 for one known item is 1 / log2(1 + rank) within the top 10.

Systems, on the same texts:
- cairn keyword / hybrid / dense: a real `python -m cairn_retrieval` (local ONNX
  embedder, Qdrant Edge in a temporary folder, the bench's PostgreSQL), whole
  documents ingested over gRPC with cairn's chunking, searched with
  SearchRequest.mode KEYWORD_ONLY / HYBRID / DENSE_ONLY, k = 50;
- library BM25: bm25s with PyStemmer's English stemmer and its English
  stopwords over fixed 200-word passages (text only), top 100;
- plain RRF: that BM25's top 100 and the same MiniLM embedder's top 100 over the
  same passages (the embedder truncating at its 256-token window as it does),
  fused with 1 / (60 + rank).

Intervals are 95% paired-bootstrap intervals over queries (2000 rounds, fixed
seed), for each mean and for the differences the targets name. The printed
table shows the previous run's figure beside each one (bench/results.json).
The size is CAIRN_BENCH_QUALITY_CHARS (characters per corpus; default 500k,
200k with --quick) and CAIRN_BENCH_QUALITY_QUERIES (default 150, 50 with --quick).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from bench.figures import Figure, bootstrap_interval, known_item_ndcg_at_10
from bench.harness import STATE
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.embedding import LocalOnnxEmbedder
from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import (
    free_port,
    stack_env,
    start_embedded_postgres,
    start_service,
    wait_for_health,
)
from cairn_retrieval.html_text import html_to_page

PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
POSTGRES_DOCS = Path("/usr/share/doc/postgresql-doc-15/html")
RESULTS = Path(__file__).parent / "results.json"

MAX_DOCUMENT_CHARS = 60_000
QUERIES_PER_DOCUMENT = 3
PASSAGE_WORDS = 200
LIBRARY_DEPTH = 100
RRF_K = 60
CAIRN_K = 50
INGEST_BATCH = 16

console = Console(stderr=True)


@dataclass(frozen=True)
class Document:
    document_id: str
    title: str
    text: str


@dataclass(frozen=True)
class KnownItem:
    query: str
    document_id: str


@dataclass(frozen=True)
class Corpus:
    name: str
    documents: list[Document]
    items: list[KnownItem]


def _sha(*parts: str) -> str:
    return hashlib.sha1("\x00".join(parts).encode()).hexdigest()


# ---------------------------------------------------------------- corpora

_RST_UNDERLINE = re.compile(r"^([=\-~^*#\"'+])\1{2,}\s*$")
_RST_ROLE = re.compile(r":[\w:.-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_SECTION_NUMBER = re.compile(r"^(?:[A-Z]?[\d.]+\.?\s+|(?:Table|Example|Figure)\s+[\w.]+\.\s+)")
_WORDS = re.compile(r"[A-Za-z]{2,}")


@dataclass(frozen=True)
class _Heading:
    query: str
    lines: tuple[int, ...]  # lines of the text that make the heading, to hold out


def _clean_heading(text: str) -> str:
    text = _RST_ROLE.sub(r"\1", text)
    text = _SECTION_NUMBER.sub("", text)
    return re.sub(r"[`*]|\\", "", text).strip()


def _python_documents() -> list[tuple[Document, list[_Heading]]]:
    found: list[tuple[Document, list[_Heading]]] = []
    for path in sorted(PYTHON_DOCS.rglob("*.rst.txt")):
        text = path.read_text(errors="replace")
        lines = text.splitlines()
        headings: list[_Heading] = []
        for i in range(1, len(lines)):
            above = lines[i - 1].strip()
            if (
                _RST_UNDERLINE.match(lines[i])
                and above
                and len(lines[i].strip()) >= len(above)
                and not _RST_UNDERLINE.match(lines[i - 1])
            ):
                held = [i - 1, i]
                if i >= 2 and _RST_UNDERLINE.match(lines[i - 2]):
                    held.insert(0, i - 2)
                headings.append(_Heading(_clean_heading(above), tuple(held)))
        if not text.strip() or not headings:
            continue
        relative = path.relative_to(PYTHON_DOCS).as_posix().removesuffix(".rst.txt")
        found.append((Document(f"py/{relative}", headings[0].query, text), headings[1:]))
    return found


def _postgres_documents() -> list[tuple[Document, list[_Heading]]]:
    found: list[tuple[Document, list[_Heading]]] = []
    for path in sorted(POSTGRES_DOCS.glob("*.html")):
        page = html_to_page(path.read_text(errors="replace"))
        if not page.text.strip():
            continue
        lines = page.text.splitlines()
        position = {line.strip(): n for n, line in reversed(list(enumerate(lines)))}
        headings = [
            _Heading(_clean_heading(h.text), (position[h.text.strip()],))
            for h in page.headings
            if h.level in (2, 3) and h.text.strip() in position
        ]
        found.append((Document(f"pg/{path.stem}", page.title, page.text), headings))
    return found


def build_corpus(
    name: str,
    documents: list[tuple[Document, list[_Heading]]],
    *,
    budget_chars: int,
    max_queries: int,
) -> Corpus:
    """The taken documents (a known item's heading held out of its text) and the
    known items, as the module docstring says."""
    ordered = sorted(documents, key=lambda d: _sha(d[0].document_id))
    taken: list[tuple[Document, list[_Heading]]] = []
    spent = 0
    for document, headings in ordered:
        if len(document.text) > MAX_DOCUMENT_CHARS:
            continue
        if spent + len(document.text) > budget_chars:
            break
        taken.append((document, headings))
        spent += len(document.text)
    heads_of: dict[str, set[str]] = {}
    for document, headings in taken:
        for heading in headings:
            heads_of.setdefault(heading.query.casefold(), set()).add(document.document_id)
    chosen: list[tuple[str, Document, _Heading]] = []
    for document, headings in taken:
        candidates = [
            h
            for h in headings
            if len(_WORDS.findall(h.query)) >= 2
            and h.query.casefold() != _clean_heading(document.title).casefold()
            and heads_of[h.query.casefold()] == {document.document_id}
        ]
        candidates.sort(key=lambda h: _sha(document.document_id, h.query))
        for heading in candidates[:QUERIES_PER_DOCUMENT]:
            chosen.append((_sha(document.document_id, heading.query), document, heading))
    chosen.sort(key=lambda c: c[0])
    held_out: dict[str, list[_Heading]] = {}
    for _, document, heading in chosen[:max_queries]:
        held_out.setdefault(document.document_id, []).append(heading)
    final: list[Document] = []
    for document, _ in taken:
        removed = {n for heading in held_out.get(document.document_id, []) for n in heading.lines}
        lines = document.text.splitlines()
        text = "\n".join(line for n, line in enumerate(lines) if n not in removed)
        final.append(Document(document.document_id, document.title, text))
    items = [
        KnownItem(heading.query, document.document_id)
        for _, document, heading in chosen[:max_queries]
    ]
    return Corpus(name, final, items)


# ---------------------------------------------------------------- scoring


def distinct(document_ids: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(document_ids))


# ---------------------------------------------------------------- the library baseline


@dataclass
class LibraryBaseline:
    """bm25s + PyStemmer over 200-word passages, and plain RRF with the embedder."""

    passages: list[str]
    owners: list[str]
    bm25: object
    stemmer: object
    vectors: np.ndarray
    embedder: LocalOnnxEmbedder

    @classmethod
    def build(cls, corpus: Corpus, embedder: LocalOnnxEmbedder) -> LibraryBaseline:
        import bm25s
        import Stemmer

        passages: list[str] = []
        owners: list[str] = []
        for document in corpus.documents:
            words = document.text.split()
            for start in range(0, len(words), PASSAGE_WORDS):
                passages.append(" ".join(words[start : start + PASSAGE_WORDS]))
                owners.append(document.document_id)
        stemmer = Stemmer.Stemmer("english")
        retriever = bm25s.BM25()
        retriever.index(
            bm25s.tokenize(passages, stopwords="en", stemmer=stemmer, show_progress=False),
            show_progress=False,
        )
        vectors = np.array(embedder.embed_sync(passages), dtype=np.float32)
        return cls(passages, owners, retriever, stemmer, vectors, embedder)

    def keyword(self, query: str) -> list[int]:
        import bm25s

        tokens = bm25s.tokenize(
            [query], stopwords="en", stemmer=self.stemmer, return_ids=False, show_progress=False
        )
        if not tokens or not tokens[0]:
            return []
        depth = min(LIBRARY_DEPTH, len(self.passages))
        found, scores = self.bm25.retrieve(tokens, k=depth, show_progress=False)  # type: ignore[attr-defined]
        return [int(i) for i, s in zip(found[0], scores[0], strict=True) if s > 0]

    def dense(self, query: str) -> list[int]:
        (vector,) = self.embedder.embed_sync([query])
        similarity = self.vectors @ np.array(vector, dtype=np.float32)
        return [int(i) for i in np.argsort(-similarity, kind="stable")[:LIBRARY_DEPTH]]

    def documents(self, passages: Sequence[int]) -> list[str]:
        return distinct([self.owners[i] for i in passages])

    def rrf(self, query: str) -> list[str]:
        fused: dict[int, float] = {}
        for ranked in (self.keyword(query), self.dense(query)):
            for position, passage in enumerate(ranked, start=1):
                fused[passage] = fused.get(passage, 0.0) + 1 / (RRF_K + position)
        ordered = sorted(fused, key=lambda p: (-fused[p], p))
        return self.documents(ordered)


# ---------------------------------------------------------------- cairn, over gRPC


class CairnUnderTest:
    def __init__(self, address: str, issuer: TokenIssuer, org_id: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = retrieval_pb2_grpc.RetrievalServiceStub(self._channel)
        self._ingester = call_metadata(
            issuer.caller_token(org_id=org_id, user_id="loader", roles=["ingester"])
        )
        self._reader = call_metadata(
            issuer.caller_token(org_id=org_id, user_id="reader", groups=["bench"])
        )

    def ingest(self, corpus: Corpus) -> tuple[int, int]:
        """(documents ingested, chunks written); a failed document is said out loud."""
        ingested = chunks = 0
        for start in range(0, len(corpus.documents), INGEST_BATCH):
            batch = [
                retrieval_pb2.Document(
                    document_id=d.document_id,
                    source=corpus.name,
                    title=d.title,
                    text=d.text,
                    acl=retrieval_pb2.Acl(groups=["bench"]),
                )
                for d in corpus.documents[start : start + INGEST_BATCH]
            ]
            for progress in self._stub.IngestDocuments(
                retrieval_pb2.IngestDocumentsRequest(documents=batch),
                metadata=self._ingester,
                timeout=600,
            ):
                if progress.result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_FAILED:
                    console.print(
                        f"[red]  {progress.result.document_id} failed: {progress.result.error}[/]"
                    )
                else:
                    ingested += 1
                    chunks += progress.result.chunks
        return ingested, chunks

    def search(self, corpus: Corpus, query: str, mode: retrieval_pb2.SearchMode) -> list[str]:
        answer = self._stub.Search(
            retrieval_pb2.SearchRequest(query=query, sources=[corpus.name], k=CAIRN_K, mode=mode),
            metadata=self._reader,
            timeout=60,
        )
        return distinct([r.document_id for r in answer.results])

    def forget(self, corpus: Corpus) -> None:
        for document in corpus.documents:
            with contextlib.suppress(grpc.RpcError):
                self._stub.DeleteDocument(
                    retrieval_pb2.DeleteDocumentRequest(document_id=document.document_id),
                    metadata=self._ingester,
                    timeout=60,
                )

    def close(self) -> None:
        self._channel.close()


# ---------------------------------------------------------------- the suite


def _previous() -> dict[str, float]:
    try:
        figures = json.loads(RESULTS.read_text()).get("figures", [])
    except (OSError, ValueError):
        return {}
    return {
        f["name"]: float(f["value"])
        for f in figures
        if isinstance(f, dict) and f.get("suite") == "quality"
    }


def _evaluate(
    corpus: Corpus, cairn: CairnUnderTest, library: LibraryBaseline
) -> dict[str, list[float]]:
    systems: dict[str, Callable[[str], list[str]]] = {
        "cairn keyword": lambda q: cairn.search(corpus, q, retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY),
        "cairn dense": lambda q: cairn.search(corpus, q, retrieval_pb2.SEARCH_MODE_DENSE_ONLY),
        "cairn hybrid": lambda q: cairn.search(corpus, q, retrieval_pb2.SEARCH_MODE_HYBRID),
        "library BM25": lambda q: library.documents(library.keyword(q)),
        "library dense": lambda q: library.documents(library.dense(q)),
        "plain RRF": library.rrf,
    }
    return {
        name: [known_item_ndcg_at_10(run(item.query), item.document_id) for item in corpus.items]
        for name, run in systems.items()
    }


def _report(
    corpus: Corpus, scores: dict[str, list[float]], parameters: dict[str, object]
) -> list[Figure]:
    previous = _previous()
    figures: list[Figure] = []
    table = Table(title=f"quality on {corpus.name}: {len(corpus.items)} held-out known items")
    for column in ("system", "nDCG@10", "95% interval", "previous run"):
        table.add_column(column, justify="left" if column == "system" else "right")

    def add(name: str, values: list[float]) -> None:
        mean = sum(values) / len(values)
        low, high = bootstrap_interval(values, seed=7)
        figure_name = f"quality {corpus.name} {name} nDCG@10"
        before = previous.get(figure_name)
        table.add_row(
            name,
            f"{mean:+.3f}" if name.startswith("Δ") else f"{mean:.3f}",
            f"[{low:+.3f}, {high:+.3f}]" if name.startswith("Δ") else f"[{low:.3f}, {high:.3f}]",
            "" if before is None else f"{before:.3f}",
        )
        figures.append(
            Figure(
                figure_name,
                mean,
                "nDCG@10",
                {**parameters, "ci95": [round(low, 4), round(high, 4)]},
            )
        )

    for name, values in scores.items():
        add(name, values)
    for ours, theirs in (("cairn keyword", "library BM25"), ("cairn hybrid", "plain RRF")):
        add(
            f"Δ {ours} − {theirs}",
            [a - b for a, b in zip(scores[ours], scores[theirs], strict=True)],
        )
    Console(width=120).print(table)
    return figures


async def run_quality(*, quick: bool = False) -> list[Figure]:
    missing = [str(p) for p in (PYTHON_DOCS, POSTGRES_DOCS) if not p.is_dir()]
    if missing:
        console.print(f"[yellow]bench quality: corpora missing ({missing}); run make bench-data[/]")
        return []
    budget = int(os.environ.get("CAIRN_BENCH_QUALITY_CHARS", 200_000 if quick else 500_000))
    max_queries = int(os.environ.get("CAIRN_BENCH_QUALITY_QUERIES", 50 if quick else 150))
    corpora = [
        build_corpus(
            "python-docs", _python_documents(), budget_chars=budget, max_queries=max_queries
        ),
        build_corpus(
            "postgres-docs", _postgres_documents(), budget_chars=budget, max_queries=max_queries
        ),
    ]

    STATE.mkdir(parents=True, exist_ok=True)
    keys = generate_dev_keypair(STATE / "keys")
    issuer = TokenIssuer.from_file(keys[0])
    pg_url = start_embedded_postgres(STATE / "pg")
    qdrant = Path(tempfile.mkdtemp(prefix="cairn-quality-"))
    port = free_port()
    env = {
        **stack_env(
            database_url=pg_url,
            keys=keys,
            qdrant_path=qdrant,
            model_url="http://127.0.0.1:9",
            addresses=dict.fromkeys(("gateway", "memory", "orchestrator"), "127.0.0.1:9")
            | {"retrieval": f"127.0.0.1:{port}"},
        ),
        "CAIRN_EMBEDDER": "local",
        "CAIRN_QDRANT_ENGINE": "edge",
        "CAIRN_LOG_LEVEL": "WARNING",
    }
    process = start_service(
        "retrieval", port=port, env=env, log_dir=STATE / "logs", suffix="-quality"
    )
    embedder = LocalOnnxEmbedder()
    figures: list[Figure] = []
    try:
        wait_for_health(process, timeout=120)
        cairn = CairnUnderTest(process.address, issuer, f"quality-{uuid.uuid4().hex[:10]}")
        try:
            for corpus in corpora:
                started = time.perf_counter()
                ingested, chunks = cairn.ingest(corpus)
                ingest_seconds = time.perf_counter() - started
                library = LibraryBaseline.build(corpus, embedder)
                console.print(
                    f"  {corpus.name}: {ingested} documents, {chunks} cairn chunks "
                    f"({ingest_seconds:.0f} s), {len(library.passages)} passages, "
                    f"{len(corpus.items)} queries"
                )
                scores = _evaluate(corpus, cairn, library)
                figures.extend(
                    _report(
                        corpus,
                        scores,
                        {
                            "queries": len(corpus.items),
                            "documents": ingested,
                            "cairn_chunks": chunks,
                            "passages": len(library.passages),
                            "budget_chars": budget,
                        },
                    )
                )
                cairn.forget(corpus)
        finally:
            cairn.close()
    finally:
        process.stop()
        shutil.rmtree(qdrant, ignore_errors=True)
    return figures
