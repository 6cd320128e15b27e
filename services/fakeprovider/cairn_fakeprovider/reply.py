"""What the model decided to say, before it is dressed in the wire format.

A reply is either text or one or more tool calls. Both the default demo behaviour and
scripted steps produce one, and the same renderer turns it into a completion object
or a stream of chunks, so a scripted answer and a default answer look alike on the
wire.

A reply is cut at the request's max_tokens the way a vendor cuts one: generation
stops mid-text (or mid-arguments), and the finish reason says "length". Tokens are
counted as four characters each, the same count the usage block reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from cairn_libs.token_estimate import CHARS_PER_TOKEN

OFFLINE_PREFIX = "[offline demo model] "
MODEL_ID = "cairn-offline-demo"

FinishReason = Literal["stop", "tool_calls", "length"]


@dataclass(frozen=True)
class PlannedToolCall:
    name: str
    # The JSON text exactly as it goes on the wire; a scripted step may make it
    # invalid on purpose to test how the caller copes.
    arguments: str


@dataclass(frozen=True)
class Reply:
    content: str | None
    tool_calls: tuple[PlannedToolCall, ...] = ()
    # Generation stopped at max_tokens before the model was done.
    cut_at_max_tokens: bool = False

    @property
    def finish_reason(self) -> FinishReason:
        if self.cut_at_max_tokens:
            return "length"
        return "tool_calls" if self.tool_calls else "stop"

    @property
    def completion_text(self) -> str:
        """The text the completion-token count is taken from."""
        if self.tool_calls:
            return "".join(call.arguments for call in self.tool_calls)
        return self.content or ""

    def limited_to(self, max_tokens: int | None) -> Reply:
        """This reply as a vendor would send it under `max_tokens`: whole if it fits,
        otherwise cut after max_tokens * 4 characters (tool-call arguments in order;
        calls the budget never reached are not sent)."""
        if max_tokens is None:
            return self
        budget = max_tokens * CHARS_PER_TOKEN
        if len(self.completion_text) <= budget:
            return self
        if not self.tool_calls:
            return replace(self, content=(self.content or "")[:budget], cut_at_max_tokens=True)
        calls: list[PlannedToolCall] = []
        for call in self.tool_calls:
            if budget <= 0:
                break
            calls.append(PlannedToolCall(call.name, call.arguments[:budget]))
            budget -= len(call.arguments)
        return replace(self, tool_calls=tuple(calls), cut_at_max_tokens=True)
