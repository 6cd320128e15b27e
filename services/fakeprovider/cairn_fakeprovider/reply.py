"""What the model decided to say, before it is dressed in the wire format.

A reply is either text or one or more tool calls. Both the default demo behaviour and
scripted steps produce one, and the same renderer turns it into a completion object
or a stream of chunks, so a scripted answer and a default answer look alike on the
wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OFFLINE_PREFIX = "[offline demo model] "
MODEL_ID = "cairn-offline-demo"

FinishReason = Literal["stop", "tool_calls"]


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

    @property
    def finish_reason(self) -> FinishReason:
        return "tool_calls" if self.tool_calls else "stop"

    @property
    def completion_text(self) -> str:
        """The text the completion-token count is taken from."""
        if self.tool_calls:
            return "".join(call.arguments for call in self.tool_calls)
        return self.content or ""
