-- Long-term memory, profile facts, erasure records and the archive of verbatim blocks.
-- Every row carries org_id and every query narrows by it (I5). Times are written from
-- the service's clock, never from now(), so expiry is testable.

CREATE TABLE memories (
    memory_id      uuid PRIMARY KEY,
    org_id         text NOT NULL,
    subject_kind   text NOT NULL,
    subject_id     text NOT NULL,
    body           text,
    body_sealed    bytea,
    text_digest    bytea,
    embedding      vector(384),
    tags           text[] NOT NULL DEFAULT '{}',
    importance     smallint NOT NULL CHECK (importance BETWEEN 1 AND 5),
    claim_type     text NOT NULL CHECK (claim_type IN ('UNKNOWN', 'USER_STATEMENT', 'INFERENCE')),
    event_at       timestamptz,
    valid_from     timestamptz,
    valid_until    timestamptz,
    author_kind    text NOT NULL CHECK (author_kind IN ('MODEL', 'PERSON')),
    author_id      text NOT NULL,
    run_id         text NOT NULL DEFAULT '',
    on_behalf_of   text NOT NULL DEFAULT '',
    source_ref     text NOT NULL DEFAULT '',
    created_at     timestamptz NOT NULL,
    expires_at     timestamptz NOT NULL,
    state          text NOT NULL CHECK (state IN ('ACTIVE', 'SUPERSEDED', 'EXPIRED', 'ERASED')),
    superseded_by  uuid,
    erased_at      timestamptz,
    CONSTRAINT erased_memories_hold_no_text CHECK (
        state <> 'ERASED'
        OR (body IS NULL AND body_sealed IS NULL AND text_digest IS NULL AND embedding IS NULL)
    )
);

-- "The same text about the same subject twice returns the existing memory": one
-- active memory per digest, enforced by the database so concurrent adds agree.
CREATE UNIQUE INDEX memories_one_active_text
    ON memories (org_id, subject_kind, subject_id, text_digest) WHERE state = 'ACTIVE';
CREATE INDEX memories_active_newest ON memories (org_id, created_at DESC) WHERE state = 'ACTIVE';
CREATE INDEX memories_by_subject ON memories (org_id, subject_kind, subject_id, created_at DESC);
CREATE INDEX memories_by_expiry ON memories (expires_at);
CREATE INDEX memories_embedding_hnsw
    ON memories USING hnsw (embedding vector_cosine_ops) WHERE state = 'ACTIVE';

CREATE TABLE profile_fact_versions (
    version_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id         text NOT NULL,
    subject_kind   text NOT NULL,
    subject_id     text NOT NULL,
    fact_key       text NOT NULL,
    value          text,
    value_sealed   bytea,
    is_current     boolean NOT NULL,
    author_kind    text NOT NULL CHECK (author_kind IN ('MODEL', 'PERSON')),
    author_id      text NOT NULL,
    run_id         text NOT NULL DEFAULT '',
    on_behalf_of   text NOT NULL DEFAULT '',
    created_at     timestamptz NOT NULL,
    expires_at     timestamptz NOT NULL,
    erased_at      timestamptz,
    CONSTRAINT erased_facts_hold_no_value CHECK (
        erased_at IS NULL OR (value IS NULL AND value_sealed IS NULL AND NOT is_current)
    )
);

CREATE UNIQUE INDEX profile_one_current
    ON profile_fact_versions (org_id, subject_kind, subject_id, fact_key) WHERE is_current;
CREATE INDEX profile_by_subject
    ON profile_fact_versions (org_id, subject_kind, subject_id, fact_key, version_id DESC);
CREATE INDEX profile_by_expiry ON profile_fact_versions (expires_at);

-- The erasure itself is on the record: who, when, how many. Never purged.
CREATE TABLE erasures (
    erasure_id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id           text NOT NULL,
    subject_kind     text NOT NULL,
    subject_id       text NOT NULL,
    erased_by        text NOT NULL,
    erased_at        timestamptz NOT NULL,
    memories_erased  integer NOT NULL,
    facts_erased     integer NOT NULL
);

CREATE INDEX erasures_by_subject ON erasures (org_id, subject_kind, subject_id, erased_at DESC);

-- The archive. One sequence for every block of every org: r<N> names one block forever.
CREATE SEQUENCE block_numbers AS bigint START 1 NO CYCLE;

-- A conversation belongs to the user who first archived into it; only they may
-- archive into, recall from or search it.
CREATE TABLE conversations (
    org_id           text NOT NULL,
    conversation_id  text NOT NULL,
    owner_user_id    text NOT NULL,
    created_at       timestamptz NOT NULL,
    PRIMARY KEY (org_id, conversation_id)
);

CREATE TABLE blocks (
    block_number     bigint PRIMARY KEY DEFAULT nextval('block_numbers'),
    org_id           text NOT NULL,
    conversation_id  text NOT NULL,
    archived_by      text NOT NULL,
    label            text NOT NULL,
    role             text NOT NULL,
    content          text,
    content_sealed   bytea,
    search           tsvector NOT NULL,
    created_at       timestamptz NOT NULL,
    FOREIGN KEY (org_id, conversation_id) REFERENCES conversations (org_id, conversation_id)
);

CREATE INDEX blocks_search ON blocks USING gin (search);
CREATE INDEX blocks_by_owner ON blocks (org_id, archived_by, block_number DESC);
CREATE INDEX blocks_by_conversation ON blocks (org_id, conversation_id, block_number DESC);
