-- Semantic recall in an org that holds a small share of all memories (10k of 1M) was
-- the slowest case, slower than an org ten times its size: the HNSW graph spans every
-- org, so a walk for a 1% org discards ~99 of each 100 neighbours it reaches (13k
-- buffers for 5 rows, 40-190 ms), while an exact answer had to fetch each of the
-- org's rows from the heap (9k rows, ~20 ms warm). The half-precision copy becomes a
-- stored column, so a btree on org_id can carry it: an exact answer for such an org is
-- then an index-only scan (9k entries, ~5 ms), and the planner, which sees the org's
-- size, picks it over the graph walk below a few tens of thousands of memories and the
-- graph above. The HNSW index moves to the column (the same values as the expression
-- it was built on), so both paths rank by the same distance.
ALTER TABLE memories ADD COLUMN embedding_half halfvec(384)
    GENERATED ALWAYS AS (embedding::halfvec(384)) STORED;
DROP INDEX memories_embedding_hnsw;
CREATE INDEX memories_embedding_hnsw
    ON memories USING hnsw (embedding_half halfvec_cosine_ops)
    WHERE state = 'ACTIVE';
CREATE INDEX memories_org_vectors
    ON memories (org_id) INCLUDE (memory_id, expires_at, valid_from, valid_until, embedding_half)
    WHERE state = 'ACTIVE' AND embedding IS NOT NULL;
