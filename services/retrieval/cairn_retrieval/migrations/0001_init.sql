-- Retrieval's own schema (search_path is set to it): documents, their chunks, and
-- the term statistics that make BM25 computable over any caller's visible set.

CREATE TABLE documents (
    org_id        text        NOT NULL,
    document_id   text        NOT NULL,
    source        text        NOT NULL,
    title         text        NOT NULL DEFAULT '',
    content_hash  text        NOT NULL,
    acl           text[]      NOT NULL,
    metadata      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    chunk_count   integer     NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, document_id)
);

CREATE INDEX documents_by_source ON documents (org_id, source);

-- A chunk is written 'pending', upserted to Qdrant, then made 'ready' in the same
-- transaction that removes the version it replaces; search reads only 'ready'.
CREATE TABLE chunks (
    org_id       text        NOT NULL,
    chunk_id     text        NOT NULL,
    document_id  text        NOT NULL,
    source       text        NOT NULL,
    acl          text[]      NOT NULL,
    title        text        NOT NULL DEFAULT '',
    text         text        NOT NULL,
    ordinal      integer     NOT NULL,
    char_start   integer     NOT NULL,
    char_end     integer     NOT NULL,
    length       integer     NOT NULL,
    state        text        NOT NULL CHECK (state IN ('pending', 'ready')),
    embedded     boolean     NOT NULL DEFAULT false,
    -- The vector Qdrant holds for this chunk. Qdrant finds the dense candidates
    -- under the ACL filter; the scores reported are recomputed from this column,
    -- one pair at a time, so they are the same floats whatever else the
    -- collection holds (Qdrant's batched float32 scoring is not, I2).
    embedding    vector,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, chunk_id),
    CHECK (0 <= char_start AND char_start < char_end),
    CHECK (length >= 0)
);

CREATE INDEX chunks_by_document ON chunks (org_id, document_id);
CREATE INDEX chunks_ready_by_source ON chunks (org_id, source) INCLUDE (chunk_id, length, acl)
    WHERE state = 'ready';

-- One row per (chunk, term): tf for BM25; df, N and avgdl are counted at query
-- time over the caller's visible chunks, never over the whole table (I2).
CREATE TABLE postings (
    org_id    text    NOT NULL,
    chunk_id  text    NOT NULL,
    term      text    NOT NULL,
    tf        integer NOT NULL CHECK (tf > 0),
    PRIMARY KEY (org_id, chunk_id, term),
    FOREIGN KEY (org_id, chunk_id) REFERENCES chunks (org_id, chunk_id) ON DELETE CASCADE
);

CREATE INDEX postings_by_term ON postings (org_id, term) INCLUDE (chunk_id, tf);
