"""A `cairn.tools.v1.ToolService` as a tool source, through its generated stub.

The channel and the metadata are the ones remote.py uses for retrieval and memory
(the lazily opened traced channel, `authorization` with the caller's own token),
except that the token beside it is minted for the `cairn-tools` audience: a
tool server learns the run it serves, and cannot present it to cairn. A gRPC
status means the call did not reach the tool, and becomes error data by cause:
DEADLINE_EXCEEDED a timeout, UNAVAILABLE an unreachable source, anything else
the status named. The tool's own failure arrives as a ToolError, kept as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grpc

from cairn.tools.v1 import tools_pb2, tools_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_orchestrator.domain import ErrorValue
from cairn_orchestrator.remote import _failure, _LazyChannel
from cairn_orchestrator.tool_sources import (
    INVALID_RESULT,
    SOURCE_FAILED,
    TIMEOUT,
    UNAVAILABLE,
    ListedTool,
    MintToolToken,
    Transport,
    listed_schema,
    result_from_json,
    source_error,
)
from cairn_orchestrator.tools import ToolContext, ToolResult


def _status_error(source: str, tool: str, exc: grpc.aio.AioRpcError, deadline: float) -> ErrorValue:
    failure = _failure(f"tool source {source!r}", exc)
    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return ErrorValue(
            TIMEOUT, f"the {source!r} source did not answer {tool} within {deadline:g} s"
        )
    if exc.code() is grpc.StatusCode.UNAVAILABLE:
        return ErrorValue(
            UNAVAILABLE, f"the {source!r} source cannot be reached now; {tool} did not run"
        )
    return ErrorValue(
        SOURCE_FAILED,
        f"the {source!r} source refused {tool} ({failure.status_code}: {failure.message[:200]})",
    )


class GrpcToolSource:
    transport: Transport = "grpc"

    def __init__(self, name: str, target: str, *, mint_token: MintToolToken) -> None:
        self.name = name
        self._channel = _LazyChannel(target)
        self._mint = mint_token

    def _stub(self) -> tools_pb2_grpc.ToolServiceAsyncStub:
        return tools_pb2_grpc.ToolServiceStub(self._channel.get())

    async def list_tools(self, *, deadline_seconds: float) -> tuple[ListedTool, ...] | ErrorValue:
        try:
            response = await self._stub().ListTools(
                tools_pb2.ListToolsRequest(),
                metadata=call_metadata(self._mint("", "")),
                timeout=deadline_seconds,
            )
        except grpc.aio.AioRpcError as exc:
            return _status_error(self.name, "ListTools", exc, deadline_seconds)
        listed: list[ListedTool] = []
        for tool in response.tools:
            schema = listed_schema(self.name, tool.name, tool.input_schema_json)
            if schema is not None:
                listed.append(
                    ListedTool(
                        name=tool.name,
                        description=tool.description,
                        parameters=schema,
                        read_only_hint=tool.read_only_hint,
                    )
                )
        return tuple(listed)

    async def invoke(
        self,
        *,
        tool: str,
        arguments: Mapping[str, Any],
        context: ToolContext,
        deadline_seconds: float,
    ) -> ToolResult | ErrorValue:
        request = tools_pb2.InvokeToolRequest(
            name=tool,
            arguments_json=json.dumps(dict(arguments), ensure_ascii=False),
            run_id=context.run_id,
            # The approval's token: stable for one approved write, across a resume.
            idempotency_key=context.confirmation_token or "",
        )
        metadata = call_metadata(
            context.credentials.caller_token, actor_token=self._mint(context.run_id, context.agent)
        )
        try:
            response = await self._stub().InvokeTool(
                request, metadata=metadata, timeout=deadline_seconds
            )
        except grpc.aio.AioRpcError as exc:
            return _status_error(self.name, tool, exc, deadline_seconds)
        outcome = response.WhichOneof("outcome")
        if outcome == "error":
            return source_error(response.error.code, response.error.message)
        if outcome == "result_json":
            return result_from_json(self.name, tool, response.result_json)
        return ErrorValue(
            INVALID_RESULT,
            f"the {self.name!r} source answered {tool} with neither a result nor an error",
        )

    async def close(self) -> None:
        await self._channel.close()
