-- Runs and their steps. Every row carries org_id and every query narrows by it (I5).
-- loop_state holds what the loop needs to continue a run from its next phase
-- (messages so far, labelled knowledge, usage, pending tool calls), written with
-- every step, so a confirmed write can resume the run without replaying anything.

CREATE TABLE runs (
    run_id            text PRIMARY KEY,
    org_id            text NOT NULL,
    user_id           text NOT NULL,
    agent             text NOT NULL,
    state             text NOT NULL CHECK (state IN (
                          'RUNNING', 'CONFIRMATION_PENDING', 'COMPLETED',
                          'FAILED', 'BUDGET_EXHAUSTED', 'CANCELLED')),
    input             text NOT NULL,
    conversation_id   text NOT NULL DEFAULT '',
    earlier_turns     jsonb NOT NULL DEFAULT '[]',
    answer            text NOT NULL DEFAULT '',
    citations         jsonb NOT NULL DEFAULT '[]',
    reason            text NOT NULL DEFAULT '',
    trace_id          text NOT NULL DEFAULT '',
    prompt_tokens     bigint NOT NULL DEFAULT 0,
    completion_tokens bigint NOT NULL DEFAULT 0,
    total_tokens      bigint NOT NULL DEFAULT 0,
    model_calls       integer NOT NULL DEFAULT 0,
    loop_state        jsonb,
    created_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at        timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX runs_by_owner ON runs (org_id, user_id, created_at DESC, run_id DESC);
CREATE INDEX runs_by_org ON runs (org_id, created_at DESC, run_id DESC);
CREATE INDEX runs_running ON runs (state) WHERE state IN ('RUNNING', 'CONFIRMATION_PENDING');

CREATE TABLE steps (
    run_id        text NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    seq           integer NOT NULL CHECK (seq > 0),
    org_id        text NOT NULL,
    kind          text NOT NULL CHECK (kind IN (
                      'MODEL_CALL', 'TOOL_CALL', 'RETRIEVAL', 'MEMORY_READ',
                      'CONFIRMATION_REQUESTED', 'CONFIRMATION_RESOLVED')),
    name          text NOT NULL,
    span_id       text NOT NULL CHECK (span_id ~ '^[0-9a-f]{16}$'),
    started_at    timestamptz NOT NULL,
    finished_at   timestamptz NOT NULL,
    detail        jsonb NOT NULL DEFAULT '{}',
    error_code    text,
    error_message text,
    PRIMARY KEY (run_id, seq)
);

CREATE INDEX steps_by_org ON steps (org_id, run_id, seq);
