-- Each check-and-take of the ledger as one function, so that a call pays one round
-- trip for it instead of a transaction of five to seven (BEGIN, the lock, the
-- reads, the write, COMMIT): measured, those round trips were nearly all of what
-- budgets and ceilings added to a call. Exactness is unchanged: the advisory lock is
-- the same one (same key, so replicas of the previous version still exclude these),
-- it is held to the end of the call's statement, and in a VOLATILE plpgsql function
-- each statement after the lock takes a fresh snapshot, so the sums see every
-- reservation and grant committed by whoever held the lock before.
--
-- The comparisons are domain.check_run_budget's and domain.check_ceiling's, made
-- here because they must be made under the lock; postgres.py passes the numbers
-- back to those pure functions, which word the refusal.
--
-- Each function also commits its statement without waiting for the WAL flush
-- (synchronous_commit off, for that transaction only): the flush was the other
-- half of the cost. These rows live at most a call (reservations) or 75 seconds
-- (ceiling buckets); a PostgreSQL crash can lose the last fraction of a second of
-- them, i.e. let a few calls more through in the minute after the crash, and
-- nothing else: the database stays consistent, and while it is up every decision
-- is exact as before.

CREATE FUNCTION reserve_run_tokens(
    p_lock_key text,
    p_org_id text,
    p_run_id text,
    p_needed bigint,
    p_remaining bigint,
    p_ttl_seconds float8
) RETURNS TABLE (reservation_id text, in_flight bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_in_flight bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_key, 0));
    SELECT COALESCE(SUM(r.tokens), 0) INTO v_in_flight
      FROM run_reservations r
     WHERE r.org_id = p_org_id AND r.run_id = p_run_id AND r.expires_at > now();
    IF p_needed + v_in_flight > p_remaining THEN
        RETURN QUERY SELECT NULL::text, v_in_flight;
        RETURN;
    END IF;
    RETURN QUERY
        INSERT INTO run_reservations AS r (org_id, run_id, tokens, expires_at)
        VALUES (p_org_id, p_run_id, p_needed, now() + make_interval(secs => p_ttl_seconds))
        RETURNING r.reservation_id::text, v_in_flight;
END
$$;

-- Buckets as domain.ceiling_bucket and ceiling_window_floor count them: a check
-- counts every bucket from floor((now - p_lookback_seconds) / p_bucket_seconds).
CREATE FUNCTION take_ceiling(
    p_lock_key text,
    p_provider text,
    p_tokens bigint,
    p_tokens_per_minute bigint,
    p_requests_per_minute bigint,
    p_bucket_seconds integer,
    p_lookback_seconds integer,
    p_retention_seconds integer
) RETURNS TABLE (
    epoch_seconds float8,
    used_tokens bigint,
    used_requests bigint,
    bucket_start bigint,
    granted boolean
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_epoch float8;
    v_floor float8;
    v_bucket float8;
    v_tokens bigint;
    v_requests bigint;
    v_granted boolean;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_key, 0));
    -- clock_timestamp(), not now(): now() is when the statement began, before the
    -- wait for the lock, and would date the grant too early.
    v_epoch := extract(epoch FROM clock_timestamp())::float8;
    v_floor := floor((v_epoch - p_lookback_seconds) / p_bucket_seconds) * p_bucket_seconds;
    v_bucket := floor(v_epoch / p_bucket_seconds) * p_bucket_seconds;
    SELECT COALESCE(SUM(c.tokens), 0), COALESCE(SUM(c.requests), 0)
      INTO v_tokens, v_requests
      FROM ceiling_usage c
     WHERE c.provider = p_provider AND c.window_start >= to_timestamp(v_floor);
    v_granted := NOT (
        (p_tokens_per_minute IS NOT NULL
            AND (p_tokens > p_tokens_per_minute OR v_tokens + p_tokens > p_tokens_per_minute))
        OR (p_requests_per_minute IS NOT NULL AND v_requests + 1 > p_requests_per_minute)
    );
    IF v_granted THEN
        INSERT INTO ceiling_usage AS c (provider, window_start, tokens, requests)
        VALUES (p_provider, to_timestamp(v_bucket), p_tokens, 1)
        ON CONFLICT (provider, window_start) DO UPDATE
           SET tokens = c.tokens + EXCLUDED.tokens, requests = c.requests + 1;
        DELETE FROM ceiling_usage c
         WHERE c.provider = p_provider
           AND c.window_start < to_timestamp(v_epoch - p_retention_seconds);
    END IF;
    RETURN QUERY SELECT v_epoch, v_tokens, v_requests, v_bucket::bigint, v_granted;
END
$$;

-- The two steps that end a call, for the same single round trip without the flush.
CREATE FUNCTION release_run_tokens(p_reservation_id uuid) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    DELETE FROM run_reservations r
     WHERE r.reservation_id = p_reservation_id OR r.expires_at < now();
END
$$;

CREATE FUNCTION settle_ceiling(p_provider text, p_bucket_start bigint, p_difference bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE ceiling_usage c SET tokens = GREATEST(c.tokens + p_difference, 0)
     WHERE c.provider = p_provider AND c.window_start = to_timestamp(p_bucket_start);
END
$$;
