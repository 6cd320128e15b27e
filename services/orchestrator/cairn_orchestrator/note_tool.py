"""`append_note`: a write tool for tests only, whose effect can be counted.

Registered only when CAIRN_TEST_WRITE_TOOL=1 (never in a deployment's default
configuration). Its effect is a row in `orchestrator_test.notes`, keyed by the
confirmation token it is handed (its idempotency key, so a second hand-over adds
nothing); `orchestrator_test.handovers` counts how many times a handler was
handed that key. So a test can tell "the write took effect exactly once" (one
row) from "the handler was asked once" (one hand-over), which is what
exactly-once across crashes and concurrent approvals is judged by.
`pause_before_seconds` / `pause_after_seconds` hold the first hand-over of a key
before or after the effect, so a test can kill the process at a known point.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import asyncpg

from cairn_libs.db import Database
from cairn_orchestrator.domain import CardDetail, ConfirmationCard, ErrorValue
from cairn_orchestrator.tools import Tool, ToolContext, ToolResult

APPEND_NOTE = "append_note"
NOTES_TABLE = "orchestrator_test.notes"

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "minLength": 1, "maxLength": 2000},
        "pause_before_seconds": {"type": "number", "minimum": 0, "maximum": 60},
        "pause_after_seconds": {"type": "number", "minimum": 0, "maximum": 60},
    },
    "required": ["text"],
    "additionalProperties": False,
}

HANDOVERS_TABLE = "orchestrator_test.handovers"

_CREATE = f"""
CREATE SCHEMA IF NOT EXISTS orchestrator_test;
CREATE TABLE IF NOT EXISTS {NOTES_TABLE} (
    idempotency_key text PRIMARY KEY,
    org_id          text NOT NULL,
    run_id          text NOT NULL,
    text            text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS {HANDOVERS_TABLE} (
    idempotency_key text PRIMARY KEY,
    handed_over     integer NOT NULL
);
"""


def append_note_tool(database: Database) -> Tool:
    created = asyncio.Lock()
    ready: list[bool] = []

    async def ensure_table(conn: asyncpg.Connection) -> None:
        async with created:
            if ready:
                return
            async with conn.transaction():
                # Several test processes may start at once; one creates, the others wait.
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext('orchestrator_test'))")
                await conn.execute(_CREATE)
            ready.append(True)

    async def handler(
        arguments: Mapping[str, Any], context: ToolContext
    ) -> ToolResult | ErrorValue:
        key = context.confirmation_token
        if not key:
            return ErrorValue("tool.failed", "append_note runs only with a confirmation token")
        async with database.pool.acquire() as conn:
            await ensure_table(conn)
            handed_over: int = await conn.fetchval(
                f"""
                INSERT INTO {HANDOVERS_TABLE} (idempotency_key, handed_over) VALUES ($1, 1)
                ON CONFLICT (idempotency_key)
                DO UPDATE SET handed_over = {HANDOVERS_TABLE}.handed_over + 1
                RETURNING handed_over
                """,
                key,
            )
        first = handed_over == 1
        if first:
            await asyncio.sleep(float(arguments.get("pause_before_seconds", 0)))
        async with database.pool.acquire() as conn:
            appended = await conn.fetchval(
                f"""
                INSERT INTO {NOTES_TABLE} (idempotency_key, org_id, run_id, text)
                VALUES ($1, $2, $3, $4)
                ON CONFLICT (idempotency_key) DO NOTHING
                RETURNING true
                """,
                key,
                context.principal.org_id,
                context.run_id,
                str(arguments["text"]),
            )
        if first:
            await asyncio.sleep(float(arguments.get("pause_after_seconds", 0)))
        return ToolResult(content={"appended": True, "already_appended": appended is None})

    def card(arguments: Mapping[str, Any], context: ToolContext) -> ConfirmationCard:
        text = str(arguments.get("text", ""))
        if context.language == "zh-Hans":
            return ConfirmationCard(
                summary="在测试记录中追加一条笔记",
                details=(CardDetail(label="笔记", value=text),),
                warnings=("仅供测试的工具：只在设置了 CAIRN_TEST_WRITE_TOOL=1 的环境中存在。",),
                language="zh-Hans",
            )
        return ConfirmationCard(
            summary="Append a note to the test ledger",
            details=(CardDetail(label="Note", value=text),),
            warnings=("A test-only tool: it exists only where CAIRN_TEST_WRITE_TOOL=1.",),
            language="en",
        )

    return Tool(
        name=APPEND_NOTE,
        description="Append a note to the test ledger (tests only).",
        parameters=_SCHEMA,
        effect="write",
        handler=handler,
        card=card,
    )
