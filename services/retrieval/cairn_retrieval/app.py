"""The retrieval service as the bootstrap sees it: its servicer, its readiness,
and the wiring from environment variables to adapters.

Readiness: SERVING when PostgreSQL is reachable and migrated. Qdrant being
unreachable does not make the service NOT_SERVING: every search can still be
answered from BM25, and each such answer says it is keyword-only and why (I11).
The readiness loop probes Qdrant too (creating the collection if missing) and
logs when its state changes.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
import structlog
from qdrant_client import AsyncQdrantClient

from cairn.retrieval.v1 import retrieval_pb2_grpc
from cairn_libs.db import Database, PoolReset, database_url, load_migrations
from cairn_libs.embed_cache import cached
from cairn_libs.embedding import LOCAL_DIMENSIONS, LOCAL_MODEL_ID, Embedder
from cairn_libs.settings import positive_whole_number
from cairn_libs.stack import REPO_ROOT
from cairn_retrieval.chunking import ChunkBudget, EmbedderTokens, EstimatedTokens
from cairn_retrieval.edge_store import EdgeVectorStore
from cairn_retrieval.embedders import EmbeddingSpace, GatewayEmbedder, retrieval_embedder_from_env
from cairn_retrieval.errors import ConfigInvalid
from cairn_retrieval.ingest import Ingestor
from cairn_retrieval.postgres.corpus_counts import PostgresCorpusCounts
from cairn_retrieval.postgres.document_reads import PostgresDocumentReads
from cairn_retrieval.postgres.document_writes import PostgresDocumentWrites
from cairn_retrieval.postgres.search_reads import PostgresSearchReads
from cairn_retrieval.postgres.vector_ledger import PostgresVectorLedger
from cairn_retrieval.repair import VectorStoreHealth
from cairn_retrieval.search import Searcher
from cairn_retrieval.servicer import INGEST_METHOD, SERVICE_NAME, RetrievalServicer
from cairn_retrieval.tokens import (
    DEFAULT_LANGUAGE,
    LANGUAGES,
    SourceAnalyzers,
    parse_source_languages,
)
from cairn_retrieval.vectors import QdrantVectorStore, VectorStore

log = structlog.get_logger(__name__)

SCHEMA = "retrieval"
DEFAULT_COLLECTION = "cairn_chunks"
MIGRATIONS = Path(__file__).parent / "migrations"
# Nothing of retrieval's stays in a session past its use: SET LOCAL only, and the
# per-document lock is released by its session or closes it (postgres.document_writes),
# so a release sends nothing but the rollback of a transaction left open.
POOL_RESET: PoolReset = "transaction"


class RetrievalApp:
    name = "retrieval"
    # Documents of a batch are checked one by one (the servicer calls the door
    # per document), so one bad document fails alone (cairn_libs.server).
    per_item_fields = {INGEST_METHOD: ("documents",)}

    def __init__(
        self,
        *,
        database: Database,
        vectors: VectorStore,
        embedder: Embedder | None,
        analyzers: SourceAnalyzers | None = None,
        budget: ChunkBudget | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.database = database
        self.vectors = vectors
        self.embedder = embedder
        # One run asks for its question's vector up to three times (the prefetch,
        # the model's own search, a recall of it), so queries are embedded once per
        # service (CAIRN_EMBED_CACHE_ENTRIES). Ingest embeds the model itself: its
        # chunk texts are new by construction, and a bulk load would evict queries.
        self.query_embedder = cached(embedder, env=env)
        self._analyzers = analyzers or SourceAnalyzers()
        self._budget = budget or chunk_budget_for(embedder)
        ledger = PostgresVectorLedger(database)
        space = EmbeddingSpace(ledger=ledger, vectors=vectors, embedder=embedder)
        self.health = VectorStoreHealth(
            ledger=ledger,
            vectors=vectors,
            model_id=embedder.model_id if embedder is not None else "",
        )
        self.ingestor = Ingestor(
            writes=PostgresDocumentWrites(database),
            reads=PostgresDocumentReads(database),
            counts=PostgresCorpusCounts(database),
            vectors=vectors,
            embedder=embedder,
            space=space,
            analyzers=self._analyzers,
            budget=self._budget,
        )
        self.searcher = Searcher(
            chunks=PostgresSearchReads(database),
            vectors=vectors,
            embedder=self.query_embedder,
            space=space,
            analyzers=self._analyzers,
            health=self.health,
        )
        self._servicer = RetrievalServicer(ingestor=self.ingestor, searcher=self.searcher)
        self._vector_store_ok: bool | None = None

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(self._servicer, server)
        return [SERVICE_NAME]

    async def start(self) -> None:
        log.info(
            "retrieval.config",
            embedder=self.embedder.model_id if self.embedder is not None else "none",
            language=self._analyzers.default.language,
            chunking=self._budget.name,
        )
        freeze_start_up_heap()

    async def ready(self) -> bool:
        database_ok = await self.database.ready()
        vector_store_ok = await self.vectors.probe()
        if vector_store_ok != self._vector_store_ok:
            if vector_store_ok:
                log.info("retrieval.vector_store_ready")
            else:
                log.warning("retrieval.vector_store_unreachable", serving="keyword-only")
            self._vector_store_ok = vector_store_ok
        if database_ok and vector_store_ok:
            # A collection wiped or replaced while we run is noticed here too.
            await self.health.check()
        return database_ok

    async def stop(self) -> None:
        if isinstance(self.embedder, GatewayEmbedder):
            await self.embedder.close()
        await self.vectors.close()
        await self.database.close()


def freeze_start_up_heap() -> None:
    """Leave what start-up loaded (modules, the model's session and vocabulary,
    descriptors) out of every later garbage collection. A full collection walks
    every tracked object; at 10k chunks the search bench saw one stop a search for
    192 ms, where the searches themselves allocate little that lives."""
    gc.collect()
    gc.freeze()


def vector_store_from_env(
    *, dimensions: int, qdrant_client: Callable[..., AsyncQdrantClient] = AsyncQdrantClient
) -> VectorStore:
    """QDRANT_URL: a Qdrant server. Otherwise an embedded store in CAIRN_QDRANT_PATH
    (default state/qdrant): CAIRN_QDRANT_ENGINE=edge (the default, Qdrant's engine
    in-process) or local (qdrant-client's local mode, exact but slow past a few
    thousand chunks)."""
    collection = os.environ.get("CAIRN_QDRANT_COLLECTION", DEFAULT_COLLECTION)
    url = os.environ.get("QDRANT_URL", "").strip()
    if url:
        return QdrantVectorStore(
            collection=collection,
            dimensions=dimensions,
            url=url,
            api_key=os.environ.get("QDRANT_API_KEY") or None,
            timeout_seconds=positive_whole_number(
                "CAIRN_QDRANT_TIMEOUT_SECONDS", 5, error=ConfigInvalid
            ),
            replication_factor=positive_whole_number(
                "CAIRN_QDRANT_REPLICATION_FACTOR", None, error=ConfigInvalid
            ),
            client=qdrant_client,
        )
    path = Path(os.environ.get("CAIRN_QDRANT_PATH", str(REPO_ROOT / "state" / "qdrant")))
    path.mkdir(parents=True, exist_ok=True)
    engine = os.environ.get("CAIRN_QDRANT_ENGINE", "edge").strip().lower()
    if engine == "edge":
        return EdgeVectorStore(
            path=str(path / "edge"), collection=collection, dimensions=dimensions
        )
    if engine == "local":
        return QdrantVectorStore(collection=collection, dimensions=dimensions, path=str(path))
    raise ConfigInvalid(
        f"CAIRN_QDRANT_ENGINE={engine!r} is not an engine; use 'edge' or 'local', "
        "or set QDRANT_URL for a Qdrant server"
    )


def chunk_budget_for(embedder: Embedder | None) -> ChunkBudget:
    """Chunks counted in the local model's own tokens whenever the vectors are
    (or, with no embedder yet, would be) the local model's; a word estimate for
    another model behind the gateway, whose tokenizer this process lacks."""
    if embedder is None or embedder.model_id == LOCAL_MODEL_ID:
        return ChunkBudget(EmbedderTokens(name="minilm-wordpiece"))
    return ChunkBudget(EstimatedTokens())


def analyzers_from_env() -> SourceAnalyzers:
    """CAIRN_RETRIEVAL_LANGUAGE (default english; `none` for no stemming) and
    CAIRN_RETRIEVAL_SOURCE_LANGUAGES (`source=language,...`) for exceptions."""
    default = os.environ.get("CAIRN_RETRIEVAL_LANGUAGE", "").strip().lower() or DEFAULT_LANGUAGE
    if default not in LANGUAGES:
        raise ConfigInvalid(
            f"CAIRN_RETRIEVAL_LANGUAGE={default!r} has no stemmer; use one of "
            f"{', '.join(sorted(LANGUAGES))}"
        )
    try:
        per_source = parse_source_languages(
            os.environ.get("CAIRN_RETRIEVAL_SOURCE_LANGUAGES", "").lower()
        )
    except ValueError as exc:
        raise ConfigInvalid(f"CAIRN_RETRIEVAL_SOURCE_LANGUAGES: {exc}") from exc
    return SourceAnalyzers(default=default, per_source=per_source)


def app_from_env() -> RetrievalApp:
    analyzers = analyzers_from_env()
    embedder = retrieval_embedder_from_env()
    dimensions = embedder.dimensions if embedder is not None else LOCAL_DIMENSIONS
    return RetrievalApp(
        database=Database(
            url=database_url(),
            schema=SCHEMA,
            migrations=load_migrations(MIGRATIONS),
            reset=POOL_RESET,
        ),
        vectors=vector_store_from_env(dimensions=dimensions),
        embedder=embedder,
        analyzers=analyzers,
    )
