-- Confirmed writes (I4), run leases, and dense step numbering without a scan.
--
-- A run is driven by one orchestrator process at a time: the one holding its lease
-- (lease_owner, renewed while it works). A run left RUNNING under a lease that ran
-- out belongs to a process that stopped; the recovery sweep gives it back to its
-- person (an approval was in flight) or ends it FAILED with the reason.
-- current_confirmation names the write the run is (or was last) waiting on.

ALTER TABLE runs
    ADD COLUMN lease_owner          text,
    ADD COLUMN lease_until          timestamptz,
    ADD COLUMN root_span_id         text NOT NULL DEFAULT '',
    ADD COLUMN current_confirmation text,
    ADD COLUMN step_count           integer NOT NULL DEFAULT 0;

UPDATE runs SET step_count = coalesce((SELECT max(seq) FROM steps WHERE steps.run_id = runs.run_id), 0);

CREATE INDEX runs_leases ON runs (lease_until) WHERE state = 'RUNNING';

-- One row per proposed write. The token is a 256-bit capability that is only
-- accepted from the run's own caller, so it is kept as is (the panel lists it).
CREATE TABLE confirmations (
    confirmation_token text PRIMARY KEY,
    org_id             text NOT NULL,
    run_id             text NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    user_id            text NOT NULL,
    tool_name          text NOT NULL,
    tool_call_id       text NOT NULL,
    arguments_json     text NOT NULL,
    card               jsonb NOT NULL,
    state              text NOT NULL CHECK (state IN (
                           'PENDING', 'APPROVED', 'EXECUTING', 'EXECUTED',
                           'DENIED', 'EXPIRED', 'ABANDONED')),
    created_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at         timestamptz NOT NULL,
    decision           text CHECK (decision IN ('approve', 'deny')),
    resolved_by        text NOT NULL DEFAULT '',
    resolved_at        timestamptz,
    note               text NOT NULL DEFAULT '',
    interrupted_at     timestamptz,
    executions         integer NOT NULL DEFAULT 0,
    result             jsonb,
    executed_at        timestamptz,
    UNIQUE (run_id, tool_call_id)
);

CREATE INDEX confirmations_by_run ON confirmations (org_id, run_id);
-- Open confirmations are found through their run (runs_running, current_confirmation).
