"""What the loop needs from the outside world, each behind a small Protocol.

The gRPC adapters in `remote.py` and the PostgreSQL store in `postgres.py` are the
real implementations; the tests put in-memory fakes in their place so each phase
of the loop can be exercised without a network. Every remote call takes the
caller's credentials explicitly, so no code path can call retrieval or memory
without the caller's own token (I1).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol

from cairn_orchestrator.domain import (
    CallCredentials,
    Citation,
    ConversationTurn,
    LoopState,
    ModelReply,
    ModelRequest,
    PageCursor,
    RecallOutcome,
    Run,
    RunState,
    RunUsage,
    SearchOutcome,
    Step,
    StepRecord,
)


class ModelGateway(Protocol):
    async def chat(
        self, request: ModelRequest, credentials: CallCredentials, *, deadline_seconds: float
    ) -> ModelReply:
        """One model call; raises DependencyFailed when the gateway refuses or is down."""
        ...


class KnowledgeSearch(Protocol):
    async def search(
        self,
        *,
        query: str,
        sources: Sequence[str],
        k: int,
        credentials: CallCredentials,
        deadline_seconds: float,
    ) -> SearchOutcome:
        """Search within what the caller may read; raises DependencyFailed."""
        ...


class MemoryRecall(Protocol):
    async def recall(
        self, *, query: str, k: int, credentials: CallCredentials, deadline_seconds: float
    ) -> RecallOutcome:
        """Active memories the caller may read; raises DependencyFailed."""
        ...


class RunStore(Protocol):
    async def create_run(
        self,
        *,
        run_id: str,
        org_id: str,
        user_id: str,
        agent: str,
        input: str,
        conversation_id: str,
        earlier_turns: Sequence[ConversationTurn],
        trace_id: str,
    ) -> Run: ...

    async def record_step(
        self, *, org_id: str, run_id: str, step: StepRecord, loop_state: LoopState | None
    ) -> Step:
        """Append a finished step (the store gives it the next seq) and, when given,
        the loop state to resume from after it."""
        ...

    async def finish_run(
        self,
        *,
        org_id: str,
        run_id: str,
        state: RunState,
        loop_state: LoopState | None,
        usage: RunUsage,
        answer: str = "",
        citations: Sequence[Citation] = (),
        reason: str = "",
    ) -> Run: ...

    async def get_run(self, *, org_id: str, run_id: str, user_id: str | None) -> Run | None:
        """The run, narrowed by org and, unless user_id is None (an admin), by owner."""
        ...

    async def list_runs(
        self, *, org_id: str, user_id: str | None, limit: int, after: PageCursor | None
    ) -> list[Run]:
        """Newest first, narrowed like get_run."""
        ...

    async def list_steps(self, *, org_id: str, run_id: str, after_seq: int = 0) -> list[Step]: ...


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)
