-- Shared counters of the gateway, so that several replicas hold one budget and one
-- ceiling together.

-- Tokens reserved by calls of a run that are still in flight. A call reserves
-- (prompt estimate + max_tokens) before it is sent and deletes its row when it ends;
-- a crashed gateway's rows stop counting at expires_at.
CREATE TABLE run_reservations (
    reservation_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    org_id text NOT NULL,
    run_id text NOT NULL,
    tokens bigint NOT NULL CHECK (tokens > 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE INDEX run_reservations_run ON run_reservations (org_id, run_id, expires_at);

-- Usage per provider in 10-second buckets (see domain.check_ceiling). A ceiling
-- belongs to the deployment's account with the vendor, shared by every tenant, so
-- these rows carry no org_id: they hold counts, never tenant data.
CREATE TABLE ceiling_usage (
    provider text NOT NULL,
    window_start timestamptz NOT NULL,
    tokens bigint NOT NULL DEFAULT 0 CHECK (tokens >= 0),
    requests bigint NOT NULL DEFAULT 0 CHECK (requests >= 0),
    PRIMARY KEY (provider, window_start)
);
