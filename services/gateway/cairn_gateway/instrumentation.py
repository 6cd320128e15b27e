"""What a model call's span says: OpenTelemetry GenAI attributes, never content.

Prompt and completion text go into a span only when the deployment sets
CAIRN_TRACE_CONTENT=true: traces are widely readable, and a prompt holds what the
caller's documents and memories say. Built as plain dicts by pure functions, so a
test can check exactly what would be recorded.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import Attempt, ChatMessage, ChatRequest, Completion, Outcome, Route
from cairn_gateway.wire import message_to_wire

AttributeValue = str | bool | int | float | Sequence[str]


def span_name(route: Route) -> str:
    return f"chat {route.model}"


def request_attributes(
    route: Route,
    provider: ProviderConfig,
    request: ChatRequest,
    *,
    reasoning_effort: str | None,
    trace_content: bool,
    retry_number: int = 0,
) -> dict[str, AttributeValue]:
    host, port = _server(provider.base_url)
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider.name,
        "gen_ai.request.model": route.model,
        "gen_ai.request.max_tokens": request.output_tokens,
        "server.address": host,
        "cairn.gateway.tier": route.tier,
    }
    if port is not None:
        attributes["server.port"] = port
    if request.temperature is not None:
        attributes["gen_ai.request.temperature"] = request.temperature
    if reasoning_effort is not None:
        attributes["cairn.gateway.reasoning_effort"] = reasoning_effort
    if request.run_id:
        attributes["cairn.run_id"] = request.run_id
    if retry_number:
        attributes["cairn.gateway.retry"] = retry_number
    if trace_content:
        attributes["gen_ai.input.messages"] = _messages_json(request.messages)
    return attributes


@functools.cache
def _server(base_url: str) -> tuple[str, int | None]:
    # Parsed once per provider, not once per call.
    url = urlsplit(base_url)
    return url.hostname or "", url.port


def result_attributes(
    attempt: Attempt, completion: Completion | None, *, trace_content: bool
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {"cairn.gateway.outcome": attempt.outcome.value}
    if attempt.http_status:
        attributes["http.response.status_code"] = attempt.http_status
    if attempt.outcome is not Outcome.OK:
        attributes["error.type"] = attempt.outcome.value
    if completion is not None:
        attributes["gen_ai.response.model"] = completion.model
        attributes["gen_ai.usage.input_tokens"] = completion.usage.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = completion.usage.completion_tokens
        attributes["gen_ai.response.finish_reasons"] = [completion.finish_reason]
        if completion.usage_estimated:
            attributes["cairn.gateway.usage_estimated"] = True
        if trace_content:
            attributes["gen_ai.output.messages"] = _messages_json([completion.message])
    return attributes


def _messages_json(messages: Sequence[ChatMessage]) -> str:
    wire: list[Mapping[str, object]] = [message_to_wire(m) for m in messages]
    return json.dumps(wire, ensure_ascii=False)
