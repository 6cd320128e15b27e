-- How a call with a run budget and a ceiling begins, in one round trip: reserve the
-- run's tokens and, only when that was granted, take the first provider's ceiling.
-- The two functions of 0003 are called in that order, so the locks are taken in one
-- order (run, then provider) and each decision is made exactly as when they are
-- called apart; the ceiling is never touched for a call its run cannot afford.

CREATE FUNCTION begin_call(
    p_run_lock_key text,
    p_org_id text,
    p_run_id text,
    p_needed bigint,
    p_remaining bigint,
    p_ttl_seconds float8,
    p_ceiling_lock_key text,
    p_provider text,
    p_tokens bigint,
    p_tokens_per_minute bigint,
    p_requests_per_minute bigint,
    p_bucket_seconds integer,
    p_lookback_seconds integer,
    p_retention_seconds integer
) RETURNS TABLE (
    reservation_id text,
    in_flight bigint,
    epoch_seconds float8,
    used_tokens bigint,
    used_requests bigint,
    bucket_start bigint,
    granted boolean
)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_reservation text;
    v_in_flight bigint;
BEGIN
    SELECT r.reservation_id, r.in_flight INTO v_reservation, v_in_flight
      FROM reserve_run_tokens(
          p_run_lock_key, p_org_id, p_run_id, p_needed, p_remaining, p_ttl_seconds
      ) r;
    IF v_reservation IS NULL THEN
        RETURN QUERY SELECT NULL::text, v_in_flight, NULL::float8, NULL::bigint,
                            NULL::bigint, NULL::bigint, NULL::boolean;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT v_reservation, v_in_flight, c.epoch_seconds, c.used_tokens, c.used_requests,
               c.bucket_start, c.granted
          FROM take_ceiling(
              p_ceiling_lock_key, p_provider, p_tokens, p_tokens_per_minute,
              p_requests_per_minute, p_bucket_seconds, p_lookback_seconds, p_retention_seconds
          ) c;
END
$$;
