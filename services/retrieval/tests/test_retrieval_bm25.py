"""MaxScore pruning returns exactly the exhaustive BM25 top k, and the per-audience
statistics stay equal to a recount, over random corpora and random writes.

The pure half runs the planner against a scorer that does in Python what the
SQL does; the database half runs the real PostgresSearchReads on PostgreSQL with
budgets small enough that the pruned passes are taken.
"""

from __future__ import annotations

import math
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn_libs.acl import AclPredicate
from cairn_libs.db import Database, load_migrations
from cairn_libs.identity import Principal
from cairn_retrieval import bm25
from cairn_retrieval.app import MIGRATIONS, SCHEMA
from cairn_retrieval.domain import DocumentAcl, IncomingDocument, Outcome
from cairn_retrieval.embedders import EmbeddingSpace
from cairn_retrieval.ingest import Ingestor
from cairn_retrieval.postgres.corpus_counts import PostgresCorpusCounts
from cairn_retrieval.postgres.document_reads import PostgresDocumentReads
from cairn_retrieval.postgres.document_writes import PostgresDocumentWrites
from cairn_retrieval.postgres.search_reads import PostgresSearchReads
from cairn_retrieval.postgres.vector_ledger import PostgresVectorLedger
from cairn_retrieval.tokens import query_terms, tokenize
from cairn_retrieval.vectors import QdrantVectorStore

# ---------------------------------------------------------------- pure

Corpus = dict[str, dict[str, int]]  # chunk id -> term -> tf


def _lengths(corpus: Corpus) -> dict[str, int]:
    return {c: sum(tfs.values()) for c, tfs in corpus.items()}


def _stats(corpus: Corpus, terms: list[str]) -> bm25.VisibleStatistics:
    return bm25.VisibleStatistics(
        chunks=len(corpus),
        total_length=sum(_lengths(corpus).values()),
        document_frequencies={t: sum(1 for tfs in corpus.values() if t in tfs) for t in terms},
    )


def _full_score(
    corpus: Corpus, chunk: str, weights: list[bm25.TermWeight], average: float
) -> float:
    length = _lengths(corpus)[chunk]
    total = 0.0
    for w in sorted(weights, key=lambda w: w.term):
        if w.term in corpus[chunk]:
            total += bm25.term_contribution(
                w, tf=corpus[chunk][w.term], length=length, average_length=average
            )
    return total


def _simulated_sql(
    corpus: Corpus, weights: list[bm25.TermWeight], average: float, limit: int
) -> object:
    """What PostgresSearchReads._score does, in Python: read essential postings, drop chunks
    below the floor, score survivors in full, keep the best `limit` and ties."""

    async def score(plan: bm25.Pass) -> Mapping[str, float]:
        by_term = {w.term: w for w in weights}
        length = _lengths(corpus)
        partial: dict[str, float] = {}
        for chunk, tfs in corpus.items():
            hits = [t for t in plan.essential if t in tfs]
            if hits:
                partial[chunk] = sum(
                    bm25.term_contribution(
                        by_term[t], tf=tfs[t], length=length[chunk], average_length=average
                    )
                    for t in hits
                )
        survivors = [c for c, p in partial.items() if p + plan.rest_bound >= plan.floor]
        if plan.best_partial is not None:
            survivors = sorted(survivors, key=lambda c: (-partial[c], c))[: plan.best_partial]
        scores = {c: _full_score(corpus, c, weights, average) for c in survivors}
        best = sorted(scores.values(), reverse=True)[:limit]
        return {c: s for c, s in scores.items() if best and s >= best[-1]}

    return score


def _zipf_corpus(rng: random.Random, chunks: int, vocabulary: list[str]) -> Corpus:
    weights = [1 / (rank + 1) for rank in range(len(vocabulary))]
    corpus: Corpus = {}
    for i in range(chunks):
        words = rng.choices(vocabulary, weights=weights, k=rng.randint(3, 40))
        corpus[f"c{i:04d}"] = dict(Counter(words))
    return corpus


VOCABULARY = [f"w{i:02d}" for i in range(30)]


@settings(max_examples=150, deadline=None, database=None)
@given(
    seed=st.integers(0, 10**6),
    size=st.integers(20, 250),
    query_size=st.integers(1, 6),
    limit=st.integers(1, 12),
    budget=st.integers(1, 60),
    probe_cost=st.sampled_from([0, 1, 40]),
)
async def test_pruned_passes_return_exactly_the_exhaustive_top_k(
    seed: int, size: int, query_size: int, limit: int, budget: int, probe_cost: int
) -> None:
    rng = random.Random(seed)
    corpus = _zipf_corpus(rng, size, VOCABULARY)
    terms = sorted(rng.sample(VOCABULARY, query_size))
    stats = _stats(corpus, terms)
    weights = bm25.term_weights(stats)
    score = _simulated_sql(corpus, weights, stats.average_length, limit)

    found, _ = await bm25.top_chunks(
        weights,
        limit,
        score,  # type: ignore[arg-type]
        budget=budget,
        exhaustive_below=0,
        probe_cost=probe_cost,
    )

    everything = {
        c: _full_score(corpus, c, weights, stats.average_length)
        for c, tfs in corpus.items()
        if any(t in tfs for t in terms)
    }
    assert found == bm25.top(everything, limit)


async def test_a_rare_term_lets_the_search_skip_the_common_terms_lists() -> None:
    rng = random.Random(3)
    corpus = _zipf_corpus(rng, 400, VOCABULARY)
    corpus["c9999"] = {"rare": 3, "w00": 2, "w01": 1}
    terms = ["rare", "w00", "w01"]
    stats = _stats(corpus, terms)
    weights = bm25.term_weights(stats)
    read: list[bm25.Pass] = []
    inner = _simulated_sql(corpus, weights, stats.average_length, 1)

    async def score(plan: bm25.Pass) -> Mapping[str, float]:
        read.append(plan)
        return await inner(plan)  # type: ignore[operator,no-any-return]

    found, trace = await bm25.top_chunks(
        weights, 1, score, budget=10, exhaustive_below=0, probe_cost=0
    )

    assert found[0][0] == "c9999"
    assert trace == bm25.SearchTrace(passes=2, pruned=True)
    assert [p.essential for p in read] == [("rare",), ("rare",)]
    assert read[0].best_partial == 1
    assert set(read[1].rest) == {"w00", "w01"}


def test_a_terms_bound_exceeds_whatever_it_adds_to_any_chunk() -> None:
    weight = bm25.TermWeight("t", df=3, idf=bm25.idf(100, 3))
    for tf in (1, 2, 10, 1000):
        for length in (1, 10, 1000):
            contribution = bm25.term_contribution(weight, tf=tf, length=length, average_length=50)
            assert contribution < weight.upper_bound


def test_the_floor_leaves_room_for_rounding_below_theta() -> None:
    assert bm25.pruning_floor(10.0) < 10.0
    assert bm25.pruning_floor(10.0) > 10.0 - 1e-6
    assert bm25.second_pass([], None) == bm25.exhaustive([])
    assert math.isinf(bm25.exhaustive([]).floor)


# ---------------------------------------------------------------- database


@pytest.fixture(scope="module")
async def store(pg_url: str) -> AsyncIterator[tuple[Database, PostgresSearchReads]]:
    db = Database(url=pg_url, schema=SCHEMA, migrations=load_migrations(MIGRATIONS))
    assert await db.ready()
    yield db, PostgresSearchReads(db)
    await db.close()


@pytest.fixture(scope="module")
async def vectors() -> AsyncIterator[QdrantVectorStore]:
    store = QdrantVectorStore(collection="unused", dimensions=4, location=":memory:")
    yield store
    await store.close()


WORDS = [f"term{i}" for i in range(60)] + ["alpha", "bravo", "charlie", "delta"]


def _documents(rng: random.Random, count: int, *, prefix: str = "d") -> list[IncomingDocument]:
    weights = [1 / (rank + 1) for rank in range(len(WORDS))]
    return [
        IncomingDocument(
            document_id=f"{prefix}{i:04d}",
            source=rng.choice(["s1", "s2"]),
            title="",
            text=" ".join(rng.choices(WORDS, weights=weights, k=rng.randint(5, 120))),
            acl=DocumentAcl(groups=(rng.choice(["g1", "g2", "g3", "g4"]),)),
        )
        for i in range(count)
    ]


def _keyword_only_ingestor(db: Database, vectors: QdrantVectorStore) -> Ingestor:
    return Ingestor(
        writes=PostgresDocumentWrites(db),
        reads=PostgresDocumentReads(db),
        counts=PostgresCorpusCounts(db),
        vectors=vectors,
        embedder=None,
        space=EmbeddingSpace(ledger=PostgresVectorLedger(db), vectors=vectors, embedder=None),
    )


async def _ingest(ingestor: Ingestor, org_id: str, documents: list[IncomingDocument]) -> None:
    loader = Principal(org_id=org_id, user_id="loader", roles=("ingester",))
    async for progress in ingestor.ingest(loader, documents):
        assert progress.result.outcome is not Outcome.FAILED, progress.result.error


def _reference(documents: list[IncomingDocument], query: str) -> dict[str, float]:
    docs = {d.document_id: Counter(tokenize(d.text)) for d in documents}
    n = len(docs)
    avgdl = sum(sum(tf.values()) for tf in docs.values()) / n
    terms = query_terms(query)
    df = {t: sum(1 for tf in docs.values() if t in tf) for t in terms}
    scores = {}
    for key, tf in docs.items():
        if any(t in tf for t in terms):
            length = sum(tf.values())
            scores[key] = sum(
                math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                * tf[t]
                * 2.2
                / (tf[t] + 1.2 * (0.25 + 0.75 * length / avgdl))
                for t in terms
                if t in tf
            )
    return scores


async def test_pruned_search_in_postgres_equals_the_reference_and_the_plain_statement(
    store: tuple[Database, PostgresSearchReads], vectors: QdrantVectorStore
) -> None:
    db, chunks = store
    rng = random.Random(17)
    org_id = f"org-prune-{uuid.uuid4().hex[:8]}"
    documents = _documents(rng, 300)
    await _ingest(_keyword_only_ingestor(db, vectors), org_id, documents)
    caller = Principal(org_id=org_id, user_id="reader", groups=("g1", "g2"))
    predicate = AclPredicate.for_caller(caller, ["s1"])
    visible = [d for d in documents if d.source == "s1" and set(d.acl.groups) & {"g1", "g2"}]
    traces = []
    for _ in range(40):
        query = " ".join(rng.sample(WORDS, rng.randint(2, 5)))
        limit = rng.choice([1, 3, 10, 20])
        found, trace = await chunks.bm25(
            predicate,
            query_terms(query),
            limit=limit,
            first_pass_postings=8,
            exhaustive_below=0,
            probe_cost=0,
        )
        traces.append(trace)
        plain = await chunks.bm25_exhaustive(predicate, query_terms(query), limit=limit)
        reference = _reference(visible, query)
        expected = sorted(reference.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        # One chunk per document here, so a chunk id names its document.
        assert [c.split("#")[0] for c, _ in found] == [d for d, _ in expected]
        for (_, score), (_, want) in zip(found, expected, strict=True):
            assert abs(score - want) <= 1e-9
        assert [c for c, _ in found] == [c for c, _ in plain]
        assert all(abs(a[1] - b[1]) <= 1e-9 for a, b in zip(found, plain, strict=True))
    assert any(t.pruned for t in traces), "the budgets should make some searches prune"


async def _recount(conn: asyncpg.Connection, org_id: str) -> tuple[object, object, object, object]:
    kept = await conn.fetch(
        "SELECT audience_id, chunks, total_length FROM retrieval.audiences "
        "WHERE org_id = $1 AND chunks > 0 ORDER BY audience_id",
        org_id,
    )
    counted = await conn.fetch(
        "SELECT audience_id, count(*) AS chunks, sum(length) AS total_length "
        "FROM retrieval.chunks WHERE org_id = $1 AND state = 'ready' "
        "GROUP BY audience_id ORDER BY audience_id",
        org_id,
    )
    kept_df = await conn.fetch(
        "SELECT term, audience_id, df FROM retrieval.term_stats WHERE org_id = $1 AND df <> 0 "
        "ORDER BY term, audience_id",
        org_id,
    )
    counted_df = await conn.fetch(
        "SELECT p.term, p.audience_id, count(*) AS df FROM retrieval.postings p "
        "JOIN retrieval.chunks c ON c.chunk_no = p.chunk_no AND c.state = 'ready' "
        "WHERE p.org_id = $1 GROUP BY p.term, p.audience_id ORDER BY p.term, p.audience_id",
        org_id,
    )
    return (
        [tuple(r) for r in kept],
        [tuple(r) for r in counted],
        [tuple(r) for r in kept_df],
        [tuple(r) for r in counted_df],
    )


async def test_audience_statistics_equal_a_recount_after_ingests_replacements_and_deletes(
    store: tuple[Database, PostgresSearchReads], vectors: QdrantVectorStore, pg_url: str
) -> None:
    db, chunks = store
    rng = random.Random(29)
    org_id = f"org-stats-{uuid.uuid4().hex[:8]}"
    ingestor = _keyword_only_ingestor(db, vectors)
    loader = Principal(org_id=org_id, user_id="loader", roles=("ingester",))
    documents = _documents(rng, 60)
    await _ingest(ingestor, org_id, documents)
    # Replace some (new text, sometimes a new ACL or source: another audience).
    replaced = [
        IncomingDocument(
            document_id=d.document_id,
            source=rng.choice(["s1", "s2"]),
            title="",
            text=" ".join(rng.choices(WORDS, k=rng.randint(5, 80))),
            acl=DocumentAcl(groups=(rng.choice(["g1", "g5"]),)),
        )
        for d in rng.sample(documents, 25)
    ]
    await _ingest(ingestor, org_id, replaced)
    for d in rng.sample(documents, 20):
        try:
            await ingestor.delete(loader, d.document_id)
        except Exception as exc:  # a document deleted twice reads as a denial
            assert type(exc).__name__ == "Denied"

    conn = await asyncpg.connect(pg_url)
    try:
        kept, counted, kept_df, counted_df = await _recount(conn, org_id)
    finally:
        await conn.close()
    assert kept == counted
    assert kept_df == counted_df
    assert counted, "some chunks should remain"


async def test_a_corpus_stored_before_audiences_keeps_its_chunks_and_statistics_after_migration(
    pg_url: str,
) -> None:
    schema = f"retrieval_migration_{uuid.uuid4().hex[:8]}"
    first, *later = load_migrations(MIGRATIONS)
    before = Database(url=pg_url, schema=schema, migrations=[first])
    assert await before.ready()
    async with before.pool.acquire() as conn:
        for chunk_id, acl, text_terms, state in (
            ("a#1", ["group:g1"], {"ledger": 2, "audit": 1}, "ready"),
            ("b#1", ["group:g1"], {"ledger": 1}, "ready"),
            ("c#1", ["group:g2"], {"audit": 3}, "ready"),
            ("d#1", ["group:g2"], {"audit": 1}, "pending"),
        ):
            await conn.execute(
                "INSERT INTO chunks (org_id, chunk_id, document_id, source, acl, text, ordinal, "
                "char_start, char_end, length, state, embedded) "
                "VALUES ('o', $1, $2, 's', $3, 'x', 0, 0, 1, $4, $5, $6)",
                chunk_id,
                chunk_id[0],
                acl,
                sum(text_terms.values()),
                state,
                chunk_id == "a#1",
            )
            for term, tf in text_terms.items():
                await conn.execute(
                    "INSERT INTO postings (org_id, chunk_id, term, tf) VALUES ('o', $1, $2, $3)",
                    chunk_id,
                    term,
                    tf,
                )
    await before.close()

    after = Database(url=pg_url, schema=schema, migrations=[first, *later])
    assert await after.ready()
    try:
        async with after.pool.acquire() as conn:
            audiences = await conn.fetch(
                "SELECT acl, chunks, total_length FROM audiences ORDER BY acl"
            )
            df = await conn.fetch(
                "SELECT t.term, a.acl, t.df FROM term_stats t "
                "JOIN audiences a USING (audience_id) ORDER BY t.term, a.acl"
            )
            postings = await conn.fetchval("SELECT count(*) FROM postings")
            model = await conn.fetchval("SELECT embedding_model FROM chunks WHERE chunk_id = 'a#1'")
        found, _ = await PostgresSearchReads(after).bm25(
            AclPredicate(org_id="o", principal_keys=("group:g1",), sources=("s",)),
            ["ledger"],
            limit=5,
        )
    finally:
        await after.close()

    assert [tuple(r) for r in audiences] == [(["group:g1"], 2, 4), (["group:g2"], 1, 3)]
    assert [tuple(r) for r in df] == [
        ("audit", ["group:g1"], 1),
        ("audit", ["group:g2"], 1),
        ("ledger", ["group:g1"], 2),
    ]
    assert postings == 4  # the pending chunk's posting is dropped
    assert model == "all-MiniLM-L6-v2-onnx-int8"
    # "ledger" once in a one-word chunk outscores twice in a three-word one.
    assert [c for c, _ in found] == ["b#1", "a#1"]
