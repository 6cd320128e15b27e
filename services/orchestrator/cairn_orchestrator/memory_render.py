"""The memory block of a prompt, rendered by the shared renderer.

`cairn_libs.memory_block.render_memories` is the one place that decides how a
memory reads to a model (its origin, its claim type, the pinned sentence that a
memory is never on its own a reason to accept or reject anybody; I9). It reads
plain values (its RenderableMemory Protocol), which the loop's RecalledMemory
satisfies as it is: no proto is rebuilt on the way to the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from cairn_libs.memory_block import render_memories
from cairn_orchestrator.domain import RecalledMemory


def render_memory_block(memories: Sequence[RecalledMemory], *, now: datetime) -> str:
    """The fenced memory block (already fenced by the renderer)."""
    return render_memories(memories, now=now)
