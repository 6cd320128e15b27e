"""Retrieval: search latency at 10k and 100k chunks for a caller who sees 10% and
one who sees 50%, ingest throughput next to the embedder's own rate, and search
quality (nDCG@10, MRR@10) of keyword, dense and hybrid on documentation nobody
on the team wrote.

Everything runs in this process on the service's own classes (Ingestor,
Searcher, the PostgreSQL adapters, the vector stores) against the benchmark's embedded
PostgreSQL: the figures are the service's work without the gRPC hop.

Dense and hybrid search are measured on both embedded engines: Qdrant Edge (the
service's default) and qdrant-client's local mode (what the tests also run).
A corpus is ingested once with both stores written, so the two engines hold the
same points. Local mode filters point by point in Python, so it gets fewer
queries at 100k chunks.

Corpora (Debian packages, installed by `make bench-data`):
- latency: the reStructuredText sources of the Python 3.11 documentation
  (python3.11-doc), one document per file, about 10k chunks; the 100k corpus is
  ten copies under other document ids and groups. Documents are spread over ten
  groups by a hash of their id; the 10% caller is in one group, the 50% caller
  in five. Embedding 100k chunks with the ONNX model on two cores takes most of
  an hour, so a copy reuses the vectors of the text it copies: the vectors are
  real model output, cached under state/bench/retrieval/ by text hash, and the
  built corpora are kept there too, keyed by CORPUS_VERSION, for later runs.
- quality: the PostgreSQL 15 HTML documentation (postgresql-doc-15), one
  document per page. Known-item queries are made mechanically: every section
  heading (h2/h3, section number removed) that heads a section in exactly one
  page is a query, and that page is its one relevant item. Results are chunks;
  a page's rank is the rank of its first chunk among the distinct pages
  returned. The manual pages are not used here (kept aside as a held-out check).
- held-out check: section 1 manual pages (/usr/share/man/man1), a fixed random
  sample rendered with man(1). The query is the page's NAME description ("list
  directory contents"), the page with its NAME section removed is the one
  relevant item: "which command does this?". The Google Cloud CLI's thousands of
  generated pages are left out. Nothing in cairn was tuned on this check.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shlex
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
from rich.console import Console

from bench.figures import Figure, bootstrap_interval, known_item_ndcg_at_10, percentile
from bench.harness import STATE
from cairn_libs.acl import AclPredicate
from cairn_libs.db import Database, load_migrations
from cairn_libs.embedding import LOCAL_DIMENSIONS, Embedder, LocalOnnxEmbedder
from cairn_libs.identity import Principal
from cairn_libs.stack import start_embedded_postgres
from cairn_retrieval.app import MIGRATIONS, POOL_RESET, SCHEMA, freeze_start_up_heap
from cairn_retrieval.domain import (
    DocumentAcl,
    IncomingDocument,
    Outcome,
    document_id_of_chunk,
    rank,
)
from cairn_retrieval.edge_store import EdgeVectorStore
from cairn_retrieval.embedders import EmbeddingSpace
from cairn_retrieval.html_text import html_to_page
from cairn_retrieval.ingest import Ingestor
from cairn_retrieval.postgres.corpus_counts import PostgresCorpusCounts
from cairn_retrieval.postgres.document_reads import PostgresDocumentReads
from cairn_retrieval.postgres.document_writes import PostgresDocumentWrites
from cairn_retrieval.postgres.search_reads import PostgresSearchReads
from cairn_retrieval.postgres.vector_ledger import PostgresVectorLedger
from cairn_retrieval.search import Searcher
from cairn_retrieval.tokens import query_terms
from cairn_retrieval.vectors import QdrantVectorStore, VectorPoint, VectorStore

CORPUS_VERSION = "v3"
ENGINES = ("edge", "local")
# Model output by text hash; it depends on the model, not on how corpora are laid out.
VECTOR_CACHE = "vectors-v1.pickle"
PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
POSTGRES_DOCS = Path("/usr/share/doc/postgresql-doc-15/html")
MAN_PAGES = Path("/usr/share/man/man1")
HELDOUT_PAGES = 1000
HELDOUT_CHARS = 3000  # the first part of each page: NAME removed, SYNOPSIS, DESCRIPTION
HERE = STATE / "retrieval"
GROUPS = 10
SOURCE = "docs"
INGEST_BATCH = 200

console = Console(stderr=True)


@dataclass(frozen=True)
class CorpusDocument:
    document_id: str
    title: str
    text: str


@dataclass(frozen=True)
class KnownItem:
    query: str
    document_id: str


# ---------------------------------------------------------------- corpora


def _missing_corpora() -> list[str]:
    return [str(p) for p in (PYTHON_DOCS, POSTGRES_DOCS) if not p.is_dir()]


_RST_UNDERLINE = re.compile(r"^([=\-~^*#\"'+])\1{2,}\s*$")


def python_docs() -> tuple[list[CorpusDocument], list[str]]:
    """The Python docs' reST sources, and their section headings (latency queries)."""
    documents: list[CorpusDocument] = []
    headings: list[str] = []
    for path in sorted(PYTHON_DOCS.rglob("*.rst.txt")):
        text = path.read_text(errors="replace")
        lines = text.splitlines()
        titles = [
            lines[i - 1].strip()
            for i in range(1, len(lines))
            if _RST_UNDERLINE.match(lines[i])
            and lines[i - 1].strip()
            and len(lines[i].strip()) >= len(lines[i - 1].strip())
            and not _RST_UNDERLINE.match(lines[i - 1])
        ]
        relative = path.relative_to(PYTHON_DOCS).as_posix().removesuffix(".rst.txt")
        if text.strip():
            documents.append(
                CorpusDocument(f"py/{relative}", titles[0] if titles else relative, text)
            )
        headings.extend(titles)
    return documents, sorted(set(headings))


_SECTION_NUMBER = re.compile(r"^(?:[A-Z]?[\d.]+\.?\s+|(?:Table|Example|Figure)\s+[\w.]+\.\s+)")


def postgres_docs() -> tuple[list[CorpusDocument], list[KnownItem]]:
    documents: list[CorpusDocument] = []
    headings_of: dict[str, set[str]] = {}
    for path in sorted(POSTGRES_DOCS.glob("*.html")):
        page = html_to_page(path.read_text(errors="replace"))
        if not page.text.strip():
            continue
        document_id = f"pg/{path.stem}"
        documents.append(CorpusDocument(document_id, page.title, page.text))
        for heading in page.headings:
            if heading.level in (2, 3):
                query = _SECTION_NUMBER.sub("", heading.text).strip()
                headings_of.setdefault(query.casefold(), set()).add(document_id)
                headings_of.setdefault("\x00" + query.casefold(), set()).add(query)
    items = [
        KnownItem(query=sorted(headings_of["\x00" + key])[0], document_id=next(iter(pages)))
        for key, pages in sorted(headings_of.items())
        if not key.startswith("\x00") and len(pages) == 1 and query_terms(key)
    ]
    return documents, items


_NAME_DASH = re.compile(r"\s+(?:-|\\-|\u2010|\u2013|\u2014)+\s+")


def _render_man_page(path: Path) -> str:
    done = subprocess.run(
        f"man -E UTF-8 -l {shlex.quote(str(path))} 2>/dev/null | col -bx",
        shell=True,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "MANWIDTH": "100", "MANROFFOPT": "-rHY=0"},  # no hyphenation
        check=False,
    )
    return done.stdout


def _split_name_section(rendered: str) -> tuple[str, str] | None:
    """(NAME description, the page without its NAME section), or None."""
    lines = rendered.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "NAME")
    except StopIteration:
        return None
    end = start + 1
    while end < len(lines) and lines[end].strip():
        end += 1
    name = " ".join(line.strip() for line in lines[start + 1 : end])
    parts = _NAME_DASH.split(name, maxsplit=1)
    if len(parts) != 2:
        return None
    body = "\n".join(lines[1:start] + lines[end:]).strip()
    return parts[1].strip(), body


def man_pages() -> tuple[list[CorpusDocument], list[KnownItem]]:
    """The held-out corpus, rendered once and kept as JSON beside the corpora."""
    kept = HERE / f"manpages-{CORPUS_VERSION}.json"
    if not MAN_PAGES.is_dir():
        return [], []
    if kept.exists():
        data = json.loads(kept.read_text())
        return (
            [CorpusDocument(**d) for d in data["documents"]],
            [KnownItem(**i) for i in data["items"]],
        )
    candidates = sorted(
        p
        for p in MAN_PAGES.glob("*.gz")
        if not p.is_symlink()
        and p.stat().st_size > 400
        # Most pages here are the Google Cloud CLI's generated reference (gcloud
        # alpha/beta/... variants of one another); a sample would be mostly those.
        and not p.name.startswith(("gcloud", "bq", "gsutil"))
    )
    random.Random(23).shuffle(candidates)
    documents: list[CorpusDocument] = []
    described: list[str] = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        for start in range(0, len(candidates), 200):
            batch = candidates[start : start + 200]
            for path, rendered in zip(batch, pool.map(_render_man_page, batch), strict=True):
                split = _split_name_section(rendered)
                if split is None:
                    continue
                description, body = split
                if len(query_terms(description)) < 2 or len(body) < 300:
                    continue
                page = path.name.removesuffix(".gz")
                documents.append(CorpusDocument(f"man/{page}", page, body[:HELDOUT_CHARS]))
                described.append(description)
            if len(documents) >= HELDOUT_PAGES:
                break
    documents, described = documents[:HELDOUT_PAGES], described[:HELDOUT_PAGES]
    counts = Counter(d.casefold() for d in described)
    items = [
        KnownItem(query=q, document_id=d.document_id)
        for d, q in zip(documents, described, strict=True)
        if counts[q.casefold()] == 1
    ]
    kept.write_text(
        json.dumps(
            {"documents": [asdict(d) for d in documents], "items": [asdict(i) for i in items]}
        )
    )
    return documents, items


def _first_chunks(documents: Sequence[CorpusDocument], wanted: int) -> list[CorpusDocument]:
    """The first documents (in path order) that together make `wanted` chunks or just more."""
    from cairn_retrieval.chunking import chunk_text

    chosen: list[CorpusDocument] = []
    total = 0
    for d in documents:
        if total >= wanted:
            break
        chosen.append(d)
        total += len(chunk_text(d.text))
    return chosen


def _group_of(document_id: str) -> str:
    digest = hashlib.sha256(document_id.encode()).digest()
    return f"g{digest[0] % GROUPS}"


def _incoming(documents: Sequence[CorpusDocument], *, copy: int = 0) -> list[IncomingDocument]:
    prefix = f"c{copy}/" if copy else ""
    return [
        IncomingDocument(
            document_id=prefix + d.document_id,
            source=SOURCE,
            title=d.title,
            text=d.text,
            acl=DocumentAcl(groups=(_group_of(prefix + d.document_id),)),
        )
        for d in documents
    ]


class VectorCache:
    """The ONNX embedder, remembering every vector it made by text hash, on disk:
    corpus copies and later runs reuse real model output instead of recomputing."""

    def __init__(self, embedder: LocalOnnxEmbedder, path: Path) -> None:
        self.model_id = embedder.model_id
        self.dimensions = embedder.dimensions
        self._embedder = embedder
        self._path = path
        self._vectors: dict[bytes, list[float]] = {}
        if path.exists():
            with path.open("rb") as f:
                self._vectors = pickle.load(f)
        self.computed = 0

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        keys = [hashlib.sha1(t.encode()).digest() for t in texts]
        missing = [t for t, k in zip(texts, keys, strict=True) if k not in self._vectors]
        if missing:
            made = await self._embedder.embed(missing)
            for t, v in zip(missing, made, strict=True):
                self._vectors[hashlib.sha1(t.encode()).digest()] = v
            self.computed += len(missing)
        return [self._vectors[k] for k in keys]

    def save(self) -> None:
        temporary = self._path.with_suffix(".tmp")
        with temporary.open("wb") as f:
            pickle.dump(self._vectors, f)
        temporary.replace(self._path)


# ---------------------------------------------------------------- stores


@dataclass
class Corpus:
    name: str
    org_id: str
    db: Database
    chunks: PostgresSearchReads
    engines: dict[str, VectorStore]

    async def close(self) -> None:
        for store in self.engines.values():
            await store.close()


def _space(db: Database, vectors: VectorStore, embedder: Embedder | None) -> EmbeddingSpace:
    return EmbeddingSpace(ledger=PostgresVectorLedger(db), vectors=vectors, embedder=embedder)


def _ingestor(db: Database, vectors: VectorStore, embedder: Embedder | None) -> Ingestor:
    return Ingestor(
        writes=PostgresDocumentWrites(db),
        reads=PostgresDocumentReads(db),
        counts=PostgresCorpusCounts(db),
        vectors=vectors,
        embedder=embedder,
        space=_space(db, vectors, embedder),
    )


def _searcher(corpus: Corpus, engine: str, embedder: Embedder | None) -> Searcher:
    """The service's Searcher over the bare model: the service puts its queries
    behind an embedding cache (RetrievalApp, CAIRN_EMBED_CACHE_ENTRIES), and these
    figures repeat each query per share and engine, so a cache here would measure
    the second ask of every query and not the model."""
    vectors = corpus.engines[engine]
    return Searcher(
        chunks=corpus.chunks,
        vectors=vectors,
        embedder=embedder,
        space=_space(corpus.db, vectors, embedder),
    )


def _stores(folder: Path) -> dict[str, VectorStore]:
    return {
        "edge": EdgeVectorStore(
            path=str(folder / "edge"), collection="chunks", dimensions=LOCAL_DIMENSIONS
        ),
        "local": QdrantVectorStore(
            collection="chunks", dimensions=LOCAL_DIMENSIONS, path=str(folder / "qdrant")
        ),
    }


class BothStores:
    """Writes go to every engine, so each holds the same points; the Ingestor
    sees one store. Identity and searches are the edge store's, the service's
    default (the benchmark's own searches name their engine)."""

    def __init__(self, stores: dict[str, VectorStore]) -> None:
        self._stores = stores

    def identity(self) -> str:
        return self._stores["edge"].identity()

    def location(self) -> str:
        return self._stores["edge"].location()

    async def store_id(self) -> str:
        return await self._stores["edge"].store_id()

    async def count(self) -> int:
        return await self._stores["edge"].count()

    async def recreate(self) -> None:
        for store in self._stores.values():
            await store.recreate()

    async def ensure_collection(self) -> None:
        for store in self._stores.values():
            await store.ensure_collection()

    async def probe(self) -> bool:
        return all([await store.probe() for store in self._stores.values()])

    async def upsert(self, org_id: str, points: Sequence[VectorPoint]) -> None:
        for store in self._stores.values():
            await store.upsert(org_id, points)

    async def search(
        self, vector: Sequence[float], predicate: AclPredicate, *, limit: int
    ) -> list[tuple[str, float]]:
        return await self._stores["edge"].search(vector, predicate, limit=limit)

    async def delete_chunks(self, org_id: str, chunk_ids: Sequence[str]) -> None:
        for store in self._stores.values():
            await store.delete_chunks(org_id, chunk_ids)

    async def delete_document(self, org_id: str, document_id: str) -> None:
        for store in self._stores.values():
            await store.delete_document(org_id, document_id)

    async def close(self) -> None:
        for store in self._stores.values():
            await store.close()


async def _forget_org(db: Database, org_id: str) -> None:
    async with db.pool.acquire() as conn:
        for table in ("postings", "term_stats", "chunks", "documents", "audiences"):
            await conn.execute(f"DELETE FROM {table} WHERE org_id = $1", org_id)


async def _forget_old_versions(db: Database) -> None:
    """Corpora of earlier CORPUS_VERSIONs: their folders and their rows, which
    would otherwise swell the tables every search reads."""
    for folder in HERE.glob("*-v*"):
        name, _, version = folder.name.rpartition("-")
        if folder.is_dir() and version != CORPUS_VERSION:
            console.print(f"  removing the old corpus {folder.name}")
            await _forget_org(db, f"bench-{name}-{version}")
            shutil.rmtree(folder, ignore_errors=True)


def _ingester(org_id: str) -> Principal:
    return Principal(org_id=org_id, user_id="bench-loader", roles=("ingester",))


async def _ingest(
    ingestor: Ingestor, org_id: str, documents: Sequence[IncomingDocument], label: str
) -> int:
    chunks = 0
    started = time.perf_counter()
    for start in range(0, len(documents), INGEST_BATCH):
        batch = documents[start : start + INGEST_BATCH]
        async for progress in ingestor.ingest(_ingester(org_id), batch):
            if progress.result.outcome is Outcome.FAILED:
                raise RuntimeError(f"{progress.result.document_id}: {progress.result.error}")
            chunks += progress.result.chunks
        console.print(
            f"  {label}: {start + len(batch)}/{len(documents)} documents, {chunks} chunks, "
            f"{time.perf_counter() - started:.0f}s"
        )
    return chunks


async def _corpus(
    db: Database,
    name: str,
    copies: Sequence[list[IncomingDocument]],
    cache: VectorCache,
) -> Corpus:
    """A corpus built once and kept: a marker file says the build finished."""
    org_id = f"bench-{name}-{CORPUS_VERSION}"
    folder = HERE / f"{name}-{CORPUS_VERSION}"
    marker = folder / "complete"
    chunks = PostgresSearchReads(db)
    if marker.exists():
        return Corpus(name, org_id, db, chunks, _stores(folder))
    console.print(f"[bold]building corpus {name}[/] (kept under {folder} for later runs)")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    await _forget_org(db, org_id)
    stores = _stores(folder)
    ingestor = _ingestor(db, BothStores(stores), cache)
    total = 0
    for number, documents in enumerate(copies):
        total += await _ingest(ingestor, org_id, documents, f"{name} copy {number}")
        cache.save()
    edge = stores["edge"]
    assert isinstance(edge, EdgeVectorStore)
    await edge.optimize()  # as the service does every OPTIMIZE_AFTER writes
    async with db.pool.acquire() as conn:
        for table in ("chunks", "postings", "term_stats", "audiences", "documents"):
            await conn.execute(f"VACUUM ANALYZE {table}")
    marker.write_text(f"{total} chunks\n")
    return Corpus(name, org_id, db, chunks, stores)


# ---------------------------------------------------------------- measuring


async def _timed(call: Callable[[], Awaitable[object]], repeat: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        await call()
    return (time.perf_counter() - started) * 1000 / repeat


async def _latencies(
    queries: Sequence[str], search: Callable[[str], Awaitable[object]]
) -> list[float]:
    for query in queries[:5]:
        await search(query)
    samples = []
    for query in queries:
        started = time.perf_counter()
        await search(query)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _reader(org_id: str, visible_share: int) -> Principal:
    groups = tuple(f"g{i}" for i in range(GROUPS * visible_share // 100))
    return Principal(org_id=org_id, user_id="bench-reader", groups=groups)


async def _measure_corpus(
    corpus: Corpus,
    embedder: LocalOnnxEmbedder,
    queries: Sequence[str],
    local_mode_queries: Sequence[str],
    size: str,
) -> list[Figure]:
    figures: list[Figure] = []
    # As the service does once started: what loading left (the corpora, local mode's
    # points) is kept out of the collections the searches would otherwise pay for.
    for store in corpus.engines.values():
        await store.count()
    freeze_start_up_heap()
    keyword_searcher = _searcher(corpus, "edge", None)
    stats = await PostgresCorpusCounts(corpus.db).counts_by_source(corpus.org_id, model_id="")
    total_chunks = sum(s.chunks for s in stats)
    for share in (10, 50):
        reader = _reader(corpus.org_id, share)
        predicate = AclPredicate.for_caller(reader, [SOURCE])
        params: dict[str, object] = {"chunks": total_chunks, "visible": f"{share}%", "k": 4}

        async def keyword(query: str, reader: Principal = reader) -> object:
            return await keyword_searcher.search(reader, query=query, sources=[SOURCE], k=4)

        async def bm25_pruned(query: str, predicate: AclPredicate = predicate) -> object:
            return await corpus.chunks.bm25(predicate, query_terms(query), limit=20)

        async def bm25_plain(query: str, predicate: AclPredicate = predicate) -> object:
            return await corpus.chunks.bm25_exhaustive(predicate, query_terms(query), limit=20)

        cells: list[tuple[str, Callable[[str], Awaitable[object]], Sequence[str], str]] = [
            ("keyword", keyword, queries, ""),
            ("bm25_statement.exhaustive", bm25_plain, queries, ""),
            ("bm25_statement.audiences_maxscore", bm25_pruned, queries, ""),
        ]
        for engine in ENGINES:
            searcher = _searcher(corpus, engine, embedder)

            async def hybrid(
                query: str, reader: Principal = reader, searcher: Searcher = searcher
            ) -> object:
                return await searcher.search(reader, query=query, sources=[SOURCE], k=4)

            async def dense(
                query: str, predicate: AclPredicate = predicate, searcher: Searcher = searcher
            ) -> object:
                _, vector, ids = await searcher.dense_candidates(query, predicate, limit=20)
                records, similarity = await corpus.chunks.visible_chunks(
                    predicate, ids, query_vector=vector, model_id=embedder.model_id
                )
                return rank((cid, similarity[cid]) for cid in ids if cid in similarity)

            engine_queries = queries if engine == "edge" else local_mode_queries
            cells.append((f"dense.{engine}", dense, engine_queries, engine))
            cells.append((f"hybrid.{engine}", hybrid, engine_queries, engine))
        for label, call, cell_queries, engine in cells:
            samples = await _latencies(cell_queries, call)
            cell = {**params, "queries": len(cell_queries)}
            if engine:
                cell["engine"] = "qdrant-edge" if engine == "edge" else "qdrant-client local mode"
            for q in (50, 99):
                figures.append(
                    Figure(
                        f"retrieval.{size}.{share}pct.{label}.p{q}",
                        percentile(samples, q),
                        "ms",
                        cell,
                    )
                )
            console.print(
                f"  {size} {share}% {label}: p50 {percentile(samples, 50):.1f} ms, "
                f"p99 {percentile(samples, 99):.1f} ms ({len(cell_queries)} queries)"
            )
    return figures


async def _ingest_throughput(
    db: Database, embedder: LocalOnnxEmbedder, documents: Sequence[CorpusDocument], quick: bool
) -> list[Figure]:
    """Fresh documents through the real Ingestor, with and without the embedder,
    next to the embedder alone on the same chunk texts."""
    from cairn_retrieval.domain import prepare_document

    wanted = 150 if quick else 400
    sample: list[CorpusDocument] = []
    chunk_texts: list[str] = []
    for d in documents:
        prepared = prepare_document("bench", _incoming([d])[0])
        sample.append(d)
        chunk_texts.extend(c.text for c in prepared.chunks)
        if len(chunk_texts) >= wanted:
            break
    figures = []
    params = {
        "chunks": len(chunk_texts),
        "documents": len(sample),
        "threads": os.environ.get("CAIRN_EMBED_THREADS", "1"),
    }
    embed_ms = await _timed(lambda: embedder.embed(chunk_texts))
    embedder_rate = len(chunk_texts) / (embed_ms / 1000)
    figures.append(Figure("retrieval.embedder.rate", embedder_rate, "chunks/s", params))
    for label, with_embedder in (("hybrid", True), ("keyword_only", False)):
        org_id = f"bench-ingest-{label}-{os.getpid()}"
        folder = HERE / f"ingest-{os.getpid()}"
        shutil.rmtree(folder, ignore_errors=True)
        vectors = EdgeVectorStore(
            path=str(folder), collection="chunks", dimensions=LOCAL_DIMENSIONS
        )
        ingestor = _ingestor(db, vectors, embedder if with_embedder else None)
        started = time.perf_counter()
        written = await _ingest(ingestor, org_id, _incoming(sample), f"ingest {label}")
        rate = written / (time.perf_counter() - started)
        figures.append(Figure(f"retrieval.ingest.{label}.rate", rate, "chunks/s", params))
        await vectors.close()
        shutil.rmtree(folder, ignore_errors=True)
        await _forget_org(db, org_id)
    for f in figures:
        console.print(f"  {f.name}: {f.value:.1f} {f.unit}")
    return figures


# ---------------------------------------------------------------- quality


def _page_ranks(chunk_ids: Sequence[str]) -> list[str]:
    pages: list[str] = []
    for chunk_id in chunk_ids:
        page = document_id_of_chunk(chunk_id)
        if page not in pages:
            pages.append(page)
    return pages


def _scores(pages: Sequence[str], relevant: str) -> tuple[float, float]:
    """nDCG@10 and MRR@10 of one known-item query (one relevant page)."""
    top = list(pages[:10])
    mrr = 1 / (top.index(relevant) + 1) if relevant in top else 0.0
    return known_item_ndcg_at_10(pages, relevant), mrr


async def _quality(
    corpus: Corpus,
    embedder: LocalOnnxEmbedder,
    items: Sequence[KnownItem],
    *,
    label: str,
    params: dict[str, object],
) -> list[Figure]:
    reader = Principal(
        org_id=corpus.org_id, user_id="bench-reader", groups=tuple(f"g{i}" for i in range(GROUPS))
    )
    predicate = AclPredicate.for_caller(reader, [SOURCE])
    searcher = _searcher(corpus, "edge", embedder)
    depth = 30
    per_query: dict[str, list[tuple[float, float]]] = {"keyword": [], "dense": [], "hybrid": []}
    for item in items:
        keyword, _ = await corpus.chunks.bm25(predicate, query_terms(item.query), limit=depth)
        _, vector, ids = await searcher.dense_candidates(item.query, predicate, limit=depth)
        _, similarity = await corpus.chunks.visible_chunks(
            predicate, ids, query_vector=vector, model_id=embedder.model_id
        )
        dense = rank((cid, similarity[cid]) for cid in ids if cid in similarity)
        hybrid = await searcher.search(reader, query=item.query, sources=[SOURCE], k=depth)
        lists = {
            "keyword": [cid for cid, _ in keyword],
            "dense": [h.chunk_id for h in dense],
            "hybrid": [h.chunk.chunk_id for h in hybrid.results],
        }
        for mode, chunk_ids in lists.items():
            per_query[mode].append(_scores(_page_ranks(chunk_ids), item.document_id))
    params = {**params, "queries": len(items), "chunks_retrieved": depth}
    figures = []
    means: dict[str, float] = {}
    for mode, scores in per_query.items():
        means[mode] = sum(n for n, _ in scores) / len(items)
        mrr = sum(r for _, r in scores) / len(items)
        figures.append(Figure(f"retrieval.{label}.{mode}.ndcg@10", means[mode], "", params))
        figures.append(Figure(f"retrieval.{label}.{mode}.mrr@10", mrr, "", params))
        console.print(f"  {label} {mode}: nDCG@10 {means[mode]:.3f}, MRR@10 {mrr:.3f}")
    best = max(("keyword", "dense"), key=lambda m: means[m])
    differences = [
        h - b for (h, _), (b, _) in zip(per_query["hybrid"], per_query[best], strict=True)
    ]
    low, high = bootstrap_interval(differences, seed=3)
    gain = sum(differences) / len(differences)
    interval = {**params, "against": best, "interval_95": [round(low, 4), round(high, 4)]}
    figures.append(Figure(f"retrieval.{label}.hybrid_gain.ndcg@10", gain, "", interval))
    console.print(
        f"  {label} hybrid - {best}: nDCG@10 {gain:+.3f} (95% paired bootstrap {low:+.3f} .. "
        f"{high:+.3f})"
    )
    return figures


async def _quality_suite(
    db: Database,
    cache: VectorCache,
    embedder: LocalOnnxEmbedder,
    documents: Sequence[CorpusDocument],
    items: Sequence[KnownItem],
    quick: bool,
) -> list[Figure]:
    corpus = await _corpus(db, "pgdocs", [_incoming(documents)], cache)
    try:
        chosen = random.Random(11).sample(list(items), 60) if quick else list(items)
        figures = await _quality(
            corpus,
            embedder,
            chosen,
            label="quality",
            params={
                "corpus": "postgresql-doc-15 HTML, one document per page",
                "query": "unique h2/h3 section heading -> its page",
            },
        )
    finally:
        await corpus.close()
    if quick:
        return figures
    pages, questions = man_pages()
    if not questions:
        console.print(
            f"[yellow]  no manual pages under {MAN_PAGES}: the held-out check is skipped[/]"
        )
        return figures
    heldout = await _corpus(db, "manpages", [_incoming(pages)], cache)
    try:
        figures += await _quality(
            heldout,
            embedder,
            questions,
            label="heldout_manpages",
            params={
                "corpus": f"man1 pages, a fixed sample of {len(pages)}, first "
                f"{HELDOUT_CHARS} characters without NAME",
                "query": "the page's NAME description -> its page",
            },
        )
    finally:
        await heldout.close()
    return figures


# ---------------------------------------------------------------- suite


async def run_retrieval(*, quick: bool = False) -> list[Figure]:
    missing = _missing_corpora()
    if missing:
        console.print(
            f"[yellow]bench retrieval: the documentation corpora are not installed "
            f"({', '.join(missing)}); run `make bench-data` (as root: apt-get install "
            "python3.11-doc postgresql-doc-15) and run the benchmark again[/]"
        )
        return []
    HERE.mkdir(parents=True, exist_ok=True)
    # The service's per-document log lines would drown the progress lines.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    pg_url = start_embedded_postgres(STATE / "pg")
    db = Database(
        url=pg_url, schema=SCHEMA, migrations=load_migrations(MIGRATIONS), reset=POOL_RESET
    )
    if not await db.ready():
        raise RuntimeError(f"the benchmark database at {pg_url} did not answer")
    embedder = LocalOnnxEmbedder(threads=2)
    cache = VectorCache(embedder, HERE / VECTOR_CACHE)
    figures: list[Figure] = []
    corpora: list[Corpus] = []
    try:
        await _forget_old_versions(db)
        python_documents, headings = python_docs()
        python_documents = _first_chunks(python_documents, 10_000)
        postgres_documents, items = postgres_docs()
        figures += await _ingest_throughput(db, embedder, postgres_documents, quick)

        rng = random.Random(7)
        queries = rng.sample(headings, 40 if quick else 200)
        sizes = [("10k", 1)] if quick else [("10k", 1), ("100k", 10)]
        for number, (size, copies) in enumerate(sizes):
            corpus = await _corpus(
                db,
                f"python-{size}",
                [_incoming(python_documents, copy=c) for c in range(copies)],
                cache,
            )
            corpora.append(corpus)
            # Qdrant local mode filters point by point in Python (seconds per
            # query at 100k): fewer of its queries keep the suite's time bounded.
            local_mode_queries = queries[: 20 if quick else 40] if size == "10k" else queries[:10]
            figures += await _measure_corpus(corpus, embedder, queries, local_mode_queries, size)
            await corpus.close()
            if number == 0:
                figures += await _quality_suite(
                    db, cache, embedder, postgres_documents, items, quick
                )
    finally:
        cache.save()
        for corpus in corpora:
            await corpus.close()
        await db.close()
    return figures


if __name__ == "__main__":
    import sys

    for figure in asyncio.run(run_retrieval(quick="--quick" in sys.argv)):
        print(figure.as_dict())
