-- Each provider's running cooldown, shared by every gateway replica (resilience.py).
-- A replica writes the end of a cooldown it began; an end already later is kept
-- (GREATEST), so no replica shortens another's. Like ceiling_usage, a provider
-- belongs to the deployment, so these rows carry no org_id and no tenant data.
-- A provider is its name at its base URL: two configurations that give one name to
-- different endpoints do not cool each other down.
CREATE TABLE provider_cooldowns (
    provider text NOT NULL,
    base_url text NOT NULL,
    cooling_until timestamptz NOT NULL,
    cause text NOT NULL CHECK (cause IN ('RATE_LIMIT', 'FAILURES')),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (provider, base_url)
);
