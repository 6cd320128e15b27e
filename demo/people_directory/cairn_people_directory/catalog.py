"""The directory's tools, described once for both transports: name, description,
argument schema, the server's own read-only hint, and the function that runs it.

Arguments are checked against the schema here, at the tool server's own door:
cairn checks them too, but a tool server trusts no caller's arguments.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import date
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from cairn_libs.identity import Principal
from cairn_people_directory.directory import Directory, Refusal


@dataclass(frozen=True, slots=True)
class Call:
    """One call as the directory sees it: the verified person, their arguments, and
    what cairn said about the run (provenance and the write's idempotency key)."""

    principal: Principal
    arguments: Mapping[str, Any]
    run_id: str = ""
    idempotency_key: str = ""


Runner = Callable[[Directory, Call], Awaitable[dict[str, Any] | Refusal]]


@dataclass(frozen=True, slots=True)
class DirectoryTool:
    name: str
    description: str
    schema: Mapping[str, Any]
    read_only: bool
    run: Runner


async def _count(directory: Directory, call: Call) -> dict[str, Any] | Refusal:
    return await directory.count_open_positions(call.principal, team=call.arguments.get("team"))


async def _balance(directory: Directory, call: Call) -> dict[str, Any] | Refusal:
    return await directory.leave_balance(call.principal, person=call.arguments.get("person"))


async def _request(directory: Directory, call: Call) -> dict[str, Any] | Refusal:
    if not call.idempotency_key:
        return Refusal(
            "invalid_arguments",
            "request_leave runs only as an approved write with an idempotency key",
        )
    try:
        start = date.fromisoformat(str(call.arguments["start_date"]))
    except ValueError:
        return Refusal(
            "invalid_arguments", f"start_date {call.arguments['start_date']!r} is not YYYY-MM-DD"
        )
    return await directory.request_leave(
        call.principal,
        start_date=start,
        days=int(call.arguments["days"]),
        note=str(call.arguments.get("note", "")),
        idempotency_key=call.idempotency_key,
        run_id=call.run_id,
    )


TOOLS: tuple[DirectoryTool, ...] = (
    DirectoryTool(
        name="count_open_positions",
        description="Count the open positions in the teams you may see (managers: their teams; HR: all).",
        schema={
            "type": "object",
            "properties": {
                "team": {"type": "string", "description": "a team id, e.g. engineering"}
            },
            "additionalProperties": False,
        },
        read_only=True,
        run=_count,
    ),
    DirectoryTool(
        name="leave_balance",
        description="Days of paid leave left this year: yours, or (managers, HR) a person's you may see.",
        schema={
            "type": "object",
            "properties": {
                "person": {"type": "string", "description": "a user id; yours if left out"}
            },
            "additionalProperties": False,
        },
        read_only=True,
        run=_balance,
    ),
    DirectoryTool(
        name="request_leave",
        description="Book paid leave for yourself from start_date for a number of days.",
        schema={
            "type": "object",
            "properties": {
                "start_date": {"type": "string", "description": "YYYY-MM-DD"},
                "days": {"type": "integer", "minimum": 1, "maximum": 30},
                "note": {"type": "string", "maxLength": 500},
            },
            "required": ["start_date", "days"],
            "additionalProperties": False,
        },
        read_only=False,
        run=_request,
    ),
)
BY_NAME = {tool.name: tool for tool in TOOLS}
_VALIDATORS = {tool.name: Draft202012Validator(tool.schema) for tool in TOOLS}


async def run_tool(directory: Directory, name: str, call: Call) -> dict[str, Any] | Refusal:
    tool = BY_NAME.get(name)
    if tool is None:
        return Refusal("not_found", f"no tool named {name!r}; tools: {', '.join(BY_NAME)}")
    error = best_match(_VALIDATORS[name].iter_errors(dict(call.arguments)))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(the arguments)"
        return Refusal("invalid_arguments", f"argument {where}: {error.message}")
    return await tool.run(directory, call)
