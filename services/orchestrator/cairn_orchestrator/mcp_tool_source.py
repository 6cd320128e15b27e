"""An MCP server (streamable HTTP) as a tool source, through the `mcp` SDK's client.

The caller's own token is the bearer credential of every request of a call, so
the server authorises the person (I1); the run's tool actor token (audience
`cairn-tools`) goes beside it as `X-Cairn-Actor`. Because the credential is the
caller's, a connection is opened per call rather than one shared session that
would carry one person's token into another's call; the HTTP connection pool
under it is shared. The token reaches the pool through a context variable read
by an httpx2 `Auth`, set for the call's own task (and the SDK's tasks it spawns),
and a request without one is never sent.

Listing (at start-up) negotiates the protocol version once; calls then pin it
(with the server's discover result on a 2026 server), and each call's session is
handed the listing made at start-up, as a long-lived session would hold it (the
SDK validates a result against the tool's output schema and would otherwise list
the tools again on every call). A call is then one round trip on a modern server,
where it was a discovery, a listing and a call.

A result is the tool's structured content when it has one, else its text,
parsed as JSON where it is JSON and kept as text where it is not (an MCP tool's
result may be prose). `isError` results are the tool's own error: a JSON
`{"code", "message"}` text keeps its code, other text becomes `tool.source_failed`.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Generator, Mapping
from typing import Any, cast

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from cairn_orchestrator.domain import ErrorValue, JSONValue
from cairn_orchestrator.tool_sources import (
    SOURCE_FAILED,
    TIMEOUT,
    UNAVAILABLE,
    ListedTool,
    MintToolToken,
    Transport,
    listed_schema,
    source_error,
)
from cairn_orchestrator.tools import ToolContext, ToolResult

ACTOR_HEADER = "X-Cairn-Actor"
# A tool result over SSE may be large; the byte cap (I10) applies after it arrived.
MAX_EVENT_BYTES = 64 * 1024 * 1024

_credentials: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "cairn_mcp_credentials", default=None
)


class _CallerBearer(httpx2.Auth):
    """The bearer of the call this request belongs to; none set is a bug, refused."""

    def auth_flow(
        self, request: httpx2.Request
    ) -> Generator[httpx2.Request, httpx2.Response, None]:
        credentials = _credentials.get()
        if credentials is None:
            raise RuntimeError("an MCP request was made outside a call's credentials")
        bearer, actor = credentials
        request.headers["Authorization"] = f"Bearer {bearer}"
        if actor:
            request.headers[ACTOR_HEADER] = f"Bearer {actor}"
        yield request


def _causes(exc: BaseException) -> Generator[BaseException, None, None]:
    yield exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _causes(inner)
    if exc.__cause__ is not None:
        yield from _causes(exc.__cause__)


def _failure_error(source: str, tool: str, exc: BaseException) -> ErrorValue:
    causes = list(_causes(exc))
    if any(isinstance(c, (httpx2.ConnectError, httpx2.ConnectTimeout)) for c in causes):
        return ErrorValue(
            UNAVAILABLE, f"the {source!r} source cannot be reached now; {tool} did not run"
        )
    status = next((c for c in causes if isinstance(c, httpx2.HTTPStatusError)), None)
    if status is not None:
        return ErrorValue(
            SOURCE_FAILED,
            f"the {source!r} source refused {tool} (HTTP {status.response.status_code})",
        )
    names = sorted({type(c).__name__ for c in causes if not isinstance(c, BaseExceptionGroup)})
    return ErrorValue(SOURCE_FAILED, f"the {source!r} source failed on {tool} ({', '.join(names)})")


def _text_of(result: types.CallToolResult) -> str:
    return "".join(c.text for c in result.content if isinstance(c, types.TextContent))


def result_of(result: types.CallToolResult) -> ToolResult | ErrorValue:
    text = _text_of(result)
    if result.is_error:
        try:
            error = json.loads(text)
        except ValueError:
            error = None
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            return source_error(error["code"], str(error.get("message", "")))
        return source_error(SOURCE_FAILED, text)
    if result.structured_content is not None:
        return ToolResult(content=result.structured_content)
    try:
        content: JSONValue = json.loads(text)
    except ValueError:
        content = text
    return ToolResult(content=content)


class McpToolSource:
    transport: Transport = "mcp"

    def __init__(self, name: str, url: str, *, mint_token: MintToolToken) -> None:
        self.name = name
        self._url = url
        self._mint = mint_token
        self._http: httpx2.AsyncClient | None = None
        self._version = "auto"
        self._discover: types.DiscoverResult | None = None
        self._listing: types.ListToolsResult | None = None

    def _pool(self) -> httpx2.AsyncClient:
        if self._http is None:
            # The call's own deadline cuts it; these only bound one stuck request.
            self._http = httpx2.AsyncClient(auth=_CallerBearer(), timeout=httpx2.Timeout(300.0))
        return self._http

    def _client(self, mode: str) -> Client:
        return Client(
            streamable_http_client(
                self._url, http_client=self._pool(), max_sse_event_size=MAX_EVENT_BYTES
            ),
            mode=mode,
            prior_discover=self._discover if mode in MODERN_PROTOCOL_VERSIONS else None,
            cache=None,
        )

    async def list_tools(self, *, deadline_seconds: float) -> tuple[ListedTool, ...] | ErrorValue:
        return await asyncio.create_task(self._list(deadline_seconds))

    async def _list(self, deadline_seconds: float) -> tuple[ListedTool, ...] | ErrorValue:
        _credentials.set((self._mint("", ""), ""))
        try:
            async with asyncio.timeout(deadline_seconds), self._client("auto") as client:
                listed = await client.list_tools()
                self._listing = listed.model_copy(deep=True)
                version = client.protocol_version
                discover = client.session.discover_result
        except TimeoutError:
            return ErrorValue(
                TIMEOUT,
                f"the {self.name!r} source did not list its tools within {deadline_seconds:g} s",
            )
        except Exception as exc:
            return _failure_error(self.name, "tools/list", exc)
        self._version = version if version in MODERN_PROTOCOL_VERSIONS and discover else "legacy"
        self._discover = discover
        tools: list[ListedTool] = []
        for tool in listed.tools:
            schema = listed_schema(self.name, tool.name, json.dumps(tool.input_schema))
            if schema is None:
                continue
            hint = bool(tool.annotations and tool.annotations.read_only_hint)
            tools.append(
                ListedTool(
                    name=tool.name,
                    description=tool.description or "",
                    parameters=schema,
                    read_only_hint=hint,
                )
            )
        return tuple(tools)

    async def invoke(
        self,
        *,
        tool: str,
        arguments: Mapping[str, Any],
        context: ToolContext,
        deadline_seconds: float,
    ) -> ToolResult | ErrorValue:
        # Its own task, so the credentials it sets are this call's alone.
        return await asyncio.create_task(
            self._invoke(tool, dict(arguments), context, deadline_seconds)
        )

    async def _invoke(
        self, tool: str, arguments: dict[str, Any], context: ToolContext, deadline_seconds: float
    ) -> ToolResult | ErrorValue:
        _credentials.set(
            (context.credentials.caller_token, self._mint(context.run_id, context.agent))
        )
        fields: dict[str, Any] = {"cairn/run_id": context.run_id}
        if context.confirmation_token:
            # Stable for one approved write, across a resume: a server may refuse a repeat.
            fields["cairn/idempotency_key"] = context.confirmation_token
        meta = cast(types.RequestParamsMeta, fields)
        try:
            async with asyncio.timeout(deadline_seconds), self._client(self._version) as client:
                self._known_tools(client)
                result = await client.call_tool(tool, arguments, meta=meta)
        except TimeoutError:
            return ErrorValue(
                TIMEOUT,
                f"the {self.name!r} source did not answer {tool} within {deadline_seconds:g} s",
            )
        except Exception as exc:
            return _failure_error(self.name, tool, exc)
        return result_of(result)

    def _known_tools(self, client: Client) -> None:
        """Seed a fresh session with the start-up listing (see the module docstring);
        an SDK without this hook lists the tools itself, which is correct, only slower."""
        absorb = getattr(client.session, "_absorb_tool_listing", None)
        if self._listing is not None and absorb is not None:
            absorb(self._listing.model_copy(deep=True), complete=True)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
