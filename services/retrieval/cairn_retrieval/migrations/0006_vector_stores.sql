-- Which store (the id made with a collection: Qdrant collection metadata, or the
-- Edge shard's id file) holds the vectors PostgreSQL wrote at each location. A
-- collection found with another id, or none, was wiped and made again or
-- replaced by something else: dense search stops, saying why, until
-- `python -m cairn_retrieval reindex vectors` rebuilds it from the vectors
-- PostgreSQL holds (chunks.embedding).
CREATE TABLE vector_stores (
    location     text        PRIMARY KEY,
    store_id     text        NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now()
);
