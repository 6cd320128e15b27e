"""The directory as an MCP server (streamable HTTP), through the `mcp` SDK's server.

The SDK's bearer middleware asks `PersonVerifier` about every request's token, so
nothing reaches a tool without a verified token; a tool then runs only for a
person (a cairn-tools service token may list, never call). A tool's refusal is
an `isError` result whose text is `{"code", "message"}`, the same data the gRPC
transport sends as a ToolError.
"""

from __future__ import annotations

import json
from typing import Any

import mcp_types as types
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from pydantic import AnyHttpUrl

from cairn_libs.errors import Unauthenticated
from cairn_libs.identity import Principal
from cairn_people_directory.catalog import BY_NAME, Call, run_tool
from cairn_people_directory.directory import DENIED, Directory, Refusal
from cairn_people_directory.door import Door, bearer


class PersonVerifier:
    """The SDK's TokenVerifier over the directory's door."""

    def __init__(self, door: Door) -> None:
        self._door = door

    async def verify_token(self, token: str) -> AccessToken | None:
        try:
            principal = self._door.person(token)
        except Unauthenticated:
            if not self._door.may_list(token):
                return None
            return AccessToken(
                token=token, client_id="cairn-tools", scopes=[], claims={"person": False}
            )
        return AccessToken(
            token=token,
            client_id=principal.user_id,
            subject=principal.user_id,
            scopes=[],
            claims={
                "person": True,
                "org": principal.org_id,
                "roles": list(principal.roles),
                "groups": list(principal.groups),
            },
        )


def _refusal(refusal: Refusal) -> types.CallToolResult:
    text = json.dumps({"code": refusal.code, "message": refusal.message})
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


def directory_mcp(directory: Directory, door: Door, *, public_url: str) -> MCPServer:
    server: MCPServer = MCPServer(
        "people-directory",
        token_verifier=PersonVerifier(door),
        auth=AuthSettings(
            issuer_url=AnyHttpUrl(public_url),
            resource_server_url=None,
        ),
    )

    async def run(name: str, arguments: dict[str, Any], ctx: Context) -> types.CallToolResult:
        token = get_access_token()
        claims = (token.claims or {}) if token is not None else {}
        if not claims.get("person"):
            return _refusal(DENIED)
        principal = Principal(
            org_id=str(claims["org"]),
            user_id=str(token.subject if token is not None else ""),
            roles=tuple(claims.get("roles", ())),
            groups=tuple(claims.get("groups", ())),
        )
        request = ctx.request_context.request
        headers = getattr(request, "headers", {}) or {}
        try:
            actor = door.provenance(bearer(headers.get("x-cairn-actor", "")))
        except Unauthenticated:
            return _refusal(
                Refusal("unauthenticated", "the actor token beside the person's is not valid")
            )
        meta = ctx.request_context.meta or {}
        call = Call(
            principal=principal,
            arguments={k: v for k, v in arguments.items() if v is not None},
            run_id=actor.run_id if actor is not None else "",
            idempotency_key=str(meta.get("cairn/idempotency_key", "")),
        )
        outcome = await run_tool(directory, name, call)
        if isinstance(outcome, Refusal):
            return _refusal(outcome)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=json.dumps(outcome))],
            structured_content=outcome,
        )

    def hint(name: str) -> types.ToolAnnotations:
        return types.ToolAnnotations(read_only_hint=BY_NAME[name].read_only)

    @server.tool(
        description=BY_NAME["count_open_positions"].description,
        annotations=hint("count_open_positions"),
    )
    async def count_open_positions(ctx: Context, team: str | None = None) -> types.CallToolResult:
        return await run("count_open_positions", {"team": team}, ctx)

    @server.tool(
        description=BY_NAME["leave_balance"].description, annotations=hint("leave_balance")
    )
    async def leave_balance(ctx: Context, person: str | None = None) -> types.CallToolResult:
        return await run("leave_balance", {"person": person}, ctx)

    @server.tool(
        description=BY_NAME["request_leave"].description, annotations=hint("request_leave")
    )
    async def request_leave(
        ctx: Context, start_date: str, days: int, note: str | None = None
    ) -> types.CallToolResult:
        return await run(
            "request_leave", {"start_date": start_date, "days": days, "note": note}, ctx
        )

    return server
