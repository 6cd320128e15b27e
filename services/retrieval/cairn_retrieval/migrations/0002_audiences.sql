-- BM25 statistics kept per audience, so a search stops counting them at query time.
--
-- An audience is every chunk of one org that shares a source and an ACL: the
-- caller's ACL predicate admits an audience whole or not at all. N, total length
-- and document frequencies are kept per audience, changed in the same
-- transaction as the chunks they count, so a caller's visible-set statistics are
-- exact sums over the audiences the predicate admits, and a write changes only
-- the rows of the audience it writes to (DESIGN I2).

CREATE TABLE audiences (
    audience_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id        text   NOT NULL,
    source        text   NOT NULL,
    acl           text[] NOT NULL,
    -- Ready chunks of the audience and the sum of their lengths.
    chunks        bigint NOT NULL DEFAULT 0 CHECK (chunks >= 0),
    total_length  bigint NOT NULL DEFAULT 0 CHECK (total_length >= 0),
    UNIQUE (org_id, source, acl)
);

INSERT INTO audiences (org_id, source, acl)
SELECT DISTINCT org_id, source, acl FROM chunks;

-- chunk_no: a small key for postings (chunk ids are long strings);
-- embedding_model: the model a chunk's vector came from ('' when it has none).
ALTER TABLE chunks
    ADD COLUMN chunk_no bigint GENERATED ALWAYS AS IDENTITY,
    ADD COLUMN audience_id bigint,
    ADD COLUMN embedding_model text NOT NULL DEFAULT '';

UPDATE chunks c SET audience_id = a.audience_id
FROM audiences a
WHERE a.org_id = c.org_id AND a.source = c.source AND a.acl = c.acl;

-- Before this migration the only embedder was the local ONNX model.
UPDATE chunks SET embedding_model = 'all-MiniLM-L6-v2-onnx-int8' WHERE embedded;

ALTER TABLE chunks ALTER COLUMN audience_id SET NOT NULL;
CREATE UNIQUE INDEX chunks_by_no ON chunks (chunk_no);
-- The visible set as an index-only scan, for the plain exhaustive statement
-- kept as a baseline and a second opinion in tests.
DROP INDEX chunks_ready_by_source;
CREATE INDEX chunks_ready_by_source ON chunks (org_id, source)
    INCLUDE (chunk_no, length, acl) WHERE state = 'ready';

-- Postings exist only for ready chunks (written when a version is published),
-- and carry what scoring needs, so a posting list is read without a join.
CREATE TABLE postings_v2 (
    org_id       text    NOT NULL,
    term         text    NOT NULL,
    chunk_no     bigint  NOT NULL,
    audience_id  bigint  NOT NULL,
    tf           integer NOT NULL CHECK (tf > 0),
    length       integer NOT NULL CHECK (length >= 0),
    PRIMARY KEY (org_id, chunk_no, term)
);

INSERT INTO postings_v2 (org_id, term, chunk_no, audience_id, tf, length)
SELECT p.org_id, p.term, c.chunk_no, c.audience_id, p.tf, c.length
FROM postings p JOIN chunks c ON c.org_id = p.org_id AND c.chunk_id = p.chunk_id
WHERE c.state = 'ready';

DROP TABLE postings;
ALTER TABLE postings_v2 RENAME TO postings;
ALTER INDEX postings_v2_pkey RENAME TO postings_pkey;
CREATE INDEX postings_by_term ON postings (org_id, term)
    INCLUDE (audience_id, chunk_no, tf, length);

CREATE TABLE term_stats (
    org_id       text   NOT NULL,
    term         text   NOT NULL,
    audience_id  bigint NOT NULL,
    -- Ready chunks of the audience holding the term. No CHECK (df >= 0): a
    -- decrement is an INSERT ... ON CONFLICT, whose proposed row is checked
    -- before the conflict turns it into an update.
    df           bigint NOT NULL,
    PRIMARY KEY (org_id, term, audience_id)
);

UPDATE audiences a SET chunks = s.n, total_length = s.total
FROM (
    SELECT audience_id, count(*) AS n, sum(length) AS total
    FROM chunks WHERE state = 'ready' GROUP BY audience_id
) s
WHERE s.audience_id = a.audience_id;

INSERT INTO term_stats (org_id, term, audience_id, df)
SELECT org_id, term, audience_id, count(*) FROM postings GROUP BY org_id, term, audience_id;

-- Re-ingesting unchanged text still embeds it when its vectors are missing or
-- came from another model: the content hash and this decide "unchanged".
ALTER TABLE documents ADD COLUMN embedding_model text NOT NULL DEFAULT '';
UPDATE documents d SET embedding_model = 'all-MiniLM-L6-v2-onnx-int8'
WHERE EXISTS (
    SELECT 1 FROM chunks c
    WHERE c.org_id = d.org_id AND c.document_id = d.document_id AND c.state = 'ready' AND c.embedded
);

-- Which embedding model a vector collection holds; vectors of two models are
-- never mixed in one collection.
CREATE TABLE vector_collections (
    -- Where the collection lives and its name, e.g. 'url=http://qdrant:6333 cairn_chunks'.
    collection  text        PRIMARY KEY,
    model_id    text        NOT NULL,
    dimensions  integer     NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now()
);
