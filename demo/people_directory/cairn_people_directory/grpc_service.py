"""The directory as a `cairn.tools.v1.ToolService` (proto in, proto out)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import structlog

from cairn.tools.v1 import tools_pb2, tools_pb2_grpc
from cairn_libs.errors import DependencyUnavailable, Unauthenticated
from cairn_people_directory.catalog import TOOLS, Call, run_tool
from cairn_people_directory.directory import Directory, Refusal
from cairn_people_directory.door import Door, bearer

log = structlog.get_logger(__name__)


def _metadata(context: grpc.aio.ServicerContext[Any, Any], key: str) -> str:
    for name, value in context.invocation_metadata() or ():
        if name == key and isinstance(value, str):
            return value
    return ""


class DirectoryToolService(tools_pb2_grpc.ToolServiceServicer):
    def __init__(self, directory: Directory, door: Door) -> None:
        self._directory = directory
        self._door = door

    async def ListTools(
        self, request: tools_pb2.ListToolsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tools_pb2.ListToolsResponse:
        if not self._door.may_list(bearer(_metadata(context, "authorization"))):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "a valid token is needed to list tools"
            )
        return tools_pb2.ListToolsResponse(
            tools=[
                tools_pb2.ToolDescription(
                    name=t.name,
                    description=t.description,
                    input_schema_json=json.dumps(t.schema),
                    read_only_hint=t.read_only,
                )
                for t in TOOLS
            ]
        )

    async def InvokeTool(
        self, request: tools_pb2.InvokeToolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tools_pb2.InvokeToolResponse:
        try:
            principal = self._door.person(bearer(_metadata(context, "authorization")))
            actor = self._door.provenance(bearer(_metadata(context, "x-cairn-actor")))
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        try:
            arguments = json.loads(request.arguments_json or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return tools_pb2.InvokeToolResponse(
                error=tools_pb2.ToolError(
                    code="invalid_arguments", message="arguments must be a JSON object"
                )
            )
        call = Call(
            principal=principal,
            arguments=arguments,
            run_id=actor.run_id if actor is not None else "",
            idempotency_key=request.idempotency_key,
        )
        try:
            outcome = await run_tool(self._directory, request.name, call)
        except DependencyUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info(
            "directory.invoked",
            tool=request.name,
            user_id=principal.user_id,
            run_id=call.run_id,
            refused=isinstance(outcome, Refusal),
        )
        if isinstance(outcome, Refusal):
            return tools_pb2.InvokeToolResponse(
                error=tools_pb2.ToolError(code=outcome.code, message=outcome.message)
            )
        return tools_pb2.InvokeToolResponse(result_json=json.dumps(outcome))
