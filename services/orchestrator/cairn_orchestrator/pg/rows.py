"""Rows of the orchestrator schema to domain values and back, and the statement
fragments several stores share (steps appended after a run's step_count, the
copies kept with them). Pure: nothing here opens a connection."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import asyncpg
import structlog

from cairn_orchestrator.confirmations import pending_view
from cairn_orchestrator.domain import (
    Citation,
    Confirmation,
    ConfirmationCard,
    ConfirmationState,
    ErrorValue,
    LoopState,
    Run,
    RunState,
    RunUsage,
    Step,
    StepKind,
    StepRecord,
    ToolCallRequest,
)

log = structlog.get_logger(__name__)

_RUN_FIELDS = (
    "run_id",
    "org_id",
    "user_id",
    "agent",
    "state",
    "input",
    "conversation_id",
    "answer",
    "citations",
    "reason",
    "trace_id",
    "root_span_id",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "model_calls",
    "created_at",
    "updated_at",
    "language",
    "language_fallback",
    "cancelled_by",
)
_CONFIRMATION_FIELDS = (
    "confirmation_token",
    "org_id",
    "run_id",
    "user_id",
    "tool_name",
    "tool_call_id",
    "arguments_json",
    "card",
    "state",
    "created_at",
    "expires_at",
    "decision",
    "resolved_by",
    "resolved_at",
    "note",
    "interrupted_at",
    "executions",
    "result",
)
RUN_COLUMNS = ", ".join(_RUN_FIELDS)
# A run with the confirmation it waits on, when it waits on one.
RUN_WITH_PENDING = (
    "SELECT "
    + ", ".join(f"r.{f}" for f in _RUN_FIELDS)
    + ", "
    + ", ".join(f"c.{f} AS c_{f}" for f in _CONFIRMATION_FIELDS)
    + " FROM runs r LEFT JOIN confirmations c ON r.state = 'CONFIRMATION_PENDING'"
    " AND c.confirmation_token = r.current_confirmation AND c.org_id = r.org_id"
)


def confirmation_from_row(row: asyncpg.Record, prefix: str = "") -> Confirmation:
    def col(name: str) -> Any:
        return row[prefix + name]

    result = col("result")
    decision = col("decision")
    return Confirmation(
        token=col("confirmation_token"),
        org_id=col("org_id"),
        run_id=col("run_id"),
        user_id=col("user_id"),
        call=ToolCallRequest(
            id=col("tool_call_id"), name=col("tool_name"), arguments_json=col("arguments_json")
        ),
        card=_card(col("card")),
        state=ConfirmationState(col("state")),
        created_at=col("created_at"),
        expires_at=col("expires_at"),
        resolved_by=col("resolved_by"),
        resolved_at=col("resolved_at"),
        decision="approve" if decision == "approve" else "deny" if decision == "deny" else None,
        note=col("note"),
        interrupted_at=col("interrupted_at"),
        executions=col("executions"),
        result=json.loads(result) if result is not None else None,
    )


def _card(raw: str) -> ConfirmationCard:
    return ConfirmationCard.from_json(json.loads(raw))


def run_from_row(row: asyncpg.Record) -> Run:
    pending = None
    if row.get("c_confirmation_token") is not None:
        pending = pending_view(confirmation_from_row(row, "c_"))
    return Run(
        run_id=row["run_id"],
        org_id=row["org_id"],
        user_id=row["user_id"],
        agent=row["agent"],
        state=RunState(row["state"]),
        input=row["input"],
        conversation_id=row["conversation_id"],
        trace_id=row["trace_id"],
        root_span_id=row["root_span_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        answer=row["answer"],
        citations=tuple(Citation.from_json(c) for c in json.loads(row["citations"])),
        reason=row["reason"],
        usage=RunUsage(
            prompt_tokens=row["prompt_tokens"],
            completion_tokens=row["completion_tokens"],
            total_tokens=row["total_tokens"],
            model_calls=row["model_calls"],
        ),
        pending_confirmation=pending,
        language="zh-Hans" if row["language"] == "zh-Hans" else "en",
        language_fallback=row["language_fallback"],
        cancelled_by=row["cancelled_by"],
    )


def step_from_row(row: asyncpg.Record) -> Step:
    error = None
    if row["error_code"] is not None:
        error = ErrorValue(code=row["error_code"], message=row["error_message"] or "")
    return Step(
        seq=row["seq"],
        kind=StepKind(row["kind"]),
        name=row["name"],
        span_id=row["span_id"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        detail=json.loads(row["detail"]),
        error=error,
    )


def json_text(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if "\\u0000" not in text:
        return text
    # The last line of defence: jsonb cannot hold U+0000. The door refuses it from
    # callers and the loop turns a model's or tool's into error data, so reaching
    # here is a bug; a run must still be stored (a failed write would leave it
    # RUNNING until its lease ended), so the character becomes U+FFFD, said in a log.
    log.warning("store.unstorable_text_replaced")
    return json.dumps(_without_nul(value), ensure_ascii=False, separators=(",", ":"))


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nul(v) for v in value]
    return value


def state_json(state: LoopState | None) -> str | None:
    return json_text(state.to_json()) if state is not None else None


def steps_arrays(steps: Sequence[StepRecord]) -> tuple[list[Any], ...]:
    """The steps as parallel arrays, for one INSERT ... SELECT FROM unnest(...)."""
    return (
        [s.kind.value for s in steps],
        [s.name for s in steps],
        [s.span_id for s in steps],
        [s.started_at for s in steps],
        [s.finished_at for s in steps],
        [json_text(dict(s.detail)) for s in steps],
        [s.error.code if s.error else None for s in steps],
        [s.error.message if s.error else None for s in steps],
    )


def insert_steps_from_run(*, count: int, arrays: int) -> str:
    """Append steps numbered after the run's previous step_count: the CTE `run` has
    already added their count (parameter $count) to it; the eight arrays of
    `steps_arrays` are parameters $arrays onwards."""
    a = [f"${arrays + i}" for i in range(8)]
    return f"""
    INSERT INTO steps (run_id, seq, org_id, kind, name, span_id, started_at, finished_at,
                       detail, error_code, error_message)
    SELECT run.run_id, run.step_count - ${count}::int + s.ord::int, run.org_id, s.kind, s.name,
           s.span_id, s.started_at, s.finished_at, s.detail::jsonb, s.error_code, s.error_message
    FROM run, unnest({a[0]}::text[], {a[1]}::text[], {a[2]}::text[], {a[3]}::timestamptz[],
                     {a[4]}::timestamptz[], {a[5]}::text[], {a[6]}::text[], {a[7]}::text[])
         WITH ORDINALITY AS s(kind, name, span_id, started_at, finished_at, detail,
                              error_code, error_message, ord)
    """


def keep_copies(*, first: int) -> str:
    """A CTE that keeps the copies the steps made (three arrays from parameter
    $first), in the statement that records them: fenced by the same `run` CTE."""
    return f"""
    , kept AS (
        INSERT INTO held_copies (org_id, subject_kind, subject_id, run_id, copied_text)
        SELECT DISTINCT run.org_id, c.kind, c.id, run.run_id, c.text
        FROM run, unnest(${first}::text[], ${first + 1}::text[], ${first + 2}::text[])
             AS c(kind, id, text)
        ON CONFLICT DO NOTHING
    )
    """


def copies_arrays(steps: Sequence[StepRecord]) -> tuple[list[str], list[str], list[str]]:
    copies = [c for step in steps for c in step.copies]
    return (
        [c.subject_kind for c in copies],
        [c.subject_id for c in copies],
        [c.text for c in copies],
    )
