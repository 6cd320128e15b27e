"""A query is embedded once per service: the service's searcher asks its model for
a repeated query's vector once, never answers one model's query with another
model's vector, and asks every time when the cache is turned off (as the
benchmark does to measure the model)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

import pytest

from cairn_libs.db import Database, load_migrations
from cairn_libs.identity import Principal
from cairn_retrieval.app import MIGRATIONS, RetrievalApp
from cairn_retrieval.domain import DocumentAcl, IncomingDocument, Outcome, SearchMode
from cairn_retrieval.edge_store import EdgeVectorStore

QUERY = "when is the bicycle shed locked"


class CountingEmbedder:
    """A deterministic model of its own id that records every text it embeds."""

    dimensions = 3

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.asked: list[str] = []

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.asked.extend(texts)
        salt = sum(map(ord, self.model_id))
        return [[float(len(t)), float((sum(map(ord, t)) + salt) % 97), 1.0] for t in texts]


@pytest.fixture
async def start_app(pg_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., RetrievalApp]]:
    """A RetrievalApp in a schema and a collection of its own, the way the
    service builds it, with the given model and environment."""
    apps: list[RetrievalApp] = []

    def start(embedder: CountingEmbedder, env: Mapping[str, str]) -> RetrievalApp:
        name = uuid.uuid4().hex[:8]
        app = RetrievalApp(
            database=Database(
                url=pg_url,
                schema=f"retrieval_cache_{name}",
                migrations=load_migrations(MIGRATIONS),
            ),
            vectors=EdgeVectorStore(path=str(tmp_path / name), collection="chunks", dimensions=3),
            embedder=embedder,
            env=env,
        )
        apps.append(app)
        return app

    yield start
    for app in apps:
        await app.stop()


async def _ingest_and_search_twice(app: RetrievalApp) -> list[object]:
    assert await app.database.ready()
    org_id = f"org-{uuid.uuid4().hex[:8]}"
    document = IncomingDocument(
        document_id="shed",
        source="handbook",
        title="Shed",
        text="The bicycle shed behind the east entrance is locked at nine every evening.",
        acl=DocumentAcl(groups=("staff",)),
    )
    loader = Principal(org_id=org_id, user_id="loader", roles=("ingester",))
    async for progress in app.ingestor.ingest(loader, [document]):
        assert progress.result.outcome is Outcome.INGESTED, progress.result.error
    reader = Principal(org_id=org_id, user_id="reader", groups=("staff",))
    answers = []
    for _ in range(2):
        answer = await app.searcher.search(reader, query=QUERY, sources=["handbook"], k=4)
        assert answer.mode is SearchMode.HYBRID, answer.mode_reason
        answers.append(answer)
    return answers


async def test_a_repeated_query_is_embedded_once_and_answered_the_same(
    start_app: Callable[..., RetrievalApp],
) -> None:
    model = CountingEmbedder("model-a")
    first, again = await _ingest_and_search_twice(start_app(model, {}))

    assert model.asked.count(QUERY) == 1
    assert first == again


async def test_a_query_embedded_by_one_model_is_embedded_again_by_another(
    start_app: Callable[..., RetrievalApp],
) -> None:
    model_a, model_b = CountingEmbedder("model-a"), CountingEmbedder("model-b")
    await _ingest_and_search_twice(start_app(model_a, {}))
    await _ingest_and_search_twice(start_app(model_b, {}))

    assert model_a.asked.count(QUERY) == 1
    assert model_b.asked.count(QUERY) == 1


async def test_with_the_cache_turned_off_every_search_embeds_its_query(
    start_app: Callable[..., RetrievalApp],
) -> None:
    model = CountingEmbedder("model-a")
    await _ingest_and_search_twice(start_app(model, {"CAIRN_EMBED_CACHE_ENTRIES": "0"}))

    assert model.asked.count(QUERY) == 2
