"""What the loop needs from the outside world, each behind a small Protocol.

The gRPC adapters in `remote.py` and the PostgreSQL store in `postgres.py` are the
real implementations; the tests put in-memory fakes in their place so each phase
of the loop can be exercised without a network. Every remote call takes the
caller's credentials explicitly, so no code path can call retrieval or memory
without the caller's own token (I1).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

from cairn_orchestrator.confirmations import Recovered, ResolutionRecord, Resolver
from cairn_orchestrator.domain import (
    ENGLISH,
    ArchivedBlock,
    CallCredentials,
    Citation,
    ClaimTypeName,
    Confirmation,
    ConfirmationProposal,
    ConversationTurn,
    Decision,
    JSONValue,
    LoopState,
    MemorySubject,
    ModelReply,
    ModelRequest,
    PageCursor,
    ProfileFact,
    RecallOutcome,
    RememberOutcome,
    Run,
    RunLanguage,
    RunState,
    RunUsage,
    SearchOutcome,
    Step,
    StepRecord,
)
from cairn_orchestrator.erasure import ErasedCopies


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
        self,
        *,
        query: str,
        k: int,
        credentials: CallCredentials,
        deadline_seconds: float,
        subject: MemorySubject | None = None,
        include_profile: bool = False,
    ) -> RecallOutcome:
        """Active memories the caller may read (of one subject, when given, with its
        profile facts when asked); raises DependencyFailed."""
        ...


class MemoryWrites(Protocol):
    """Writes to long-term memory. The memory service takes the author and the run
    from the actor token in `credentials`, never from these arguments (I9)."""

    async def remember(
        self,
        *,
        text: str,
        subject: MemorySubject,
        claim_type: ClaimTypeName,
        tags: Sequence[str],
        importance: int,
        credentials: CallCredentials,
        deadline_seconds: float,
    ) -> RememberOutcome: ...

    async def update_profile(
        self,
        *,
        subject: MemorySubject,
        key: str,
        value: str,
        previous_value: str | None,
        credentials: CallCredentials,
        deadline_seconds: float,
    ) -> ProfileFact: ...


class BlockArchive(Protocol):
    """The archive of verbatim conversation blocks, each named r<N>."""

    async def archive(
        self,
        *,
        label: str,
        role: str,
        content: str,
        conversation_id: str,
        credentials: CallCredentials,
        deadline_seconds: float,
        subjects: Sequence[MemorySubject] = (),
    ) -> str:
        """The new block's id, e.g. "r7"; raises DependencyFailed. `subjects`: whom
        the block is about besides its archiver (a Forget of any of them erases it)."""
        ...

    async def recall_block(
        self, *, block_id: str, credentials: CallCredentials, deadline_seconds: float
    ) -> ArchivedBlock: ...

    async def search_blocks(
        self, *, query: str, limit: int, credentials: CallCredentials, deadline_seconds: float
    ) -> list[ArchivedBlock]: ...


class MemoryService(MemoryRecall, MemoryWrites, BlockArchive, Protocol):
    """Everything the built-in memory tools use."""


class RunStore(Protocol):
    async def conversation_subjects(
        self, *, org_id: str, conversation_id: str
    ) -> tuple[MemorySubject, ...]:
        """Whom earlier runs of this conversation copied texts about (I9)."""
        ...

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
        root_span_id: str = "",
        language: RunLanguage = ENGLISH,
    ) -> Run: ...

    async def record_step(
        self, *, org_id: str, run_id: str, step: StepRecord, loop_state: LoopState | None
    ) -> Step:
        """Append a finished step (the store gives it the next seq) and, when given,
        the loop state to resume from after it."""
        ...

    async def record_steps(
        self,
        *,
        org_id: str,
        run_id: str,
        steps: Sequence[StepRecord],
        loop_state: LoopState | None,
    ) -> list[Step]:
        """Several steps that finished together, in order, in one write."""
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
        steps: Sequence[StepRecord] = (),
    ) -> Run:
        """End the run; `steps` are appended with it, all or nothing."""
        ...

    async def get_run(self, *, org_id: str, run_id: str, user_id: str | None) -> Run | None:
        """The run, narrowed by org and, unless user_id is None (an admin), by owner."""
        ...

    async def list_runs(
        self,
        *,
        org_id: str,
        user_id: str | None,
        limit: int,
        after: PageCursor | None,
        state: RunState | None = None,
    ) -> list[Run]:
        """Newest first, narrowed like get_run."""
        ...

    async def list_steps(self, *, org_id: str, run_id: str, after_seq: int = 0) -> list[Step]: ...


class CopyStore(Protocol):
    """The copies runs keep of texts about subjects (postgres.py, erasure.py)."""

    async def erase_copies(
        self, *, org_id: str, subject_kind: str, subject_id: str
    ) -> ErasedCopies: ...


class RunCancels(Protocol):
    """A person cancels a run (pg/cancels.py); each method is one transaction."""

    async def cancel_run(
        self, *, org_id: str, run_id: str, user_id: str, words: str, span_id: str
    ) -> Run | RunState | None:
        """The cancelled run; the state it already ended in; None: not the caller's."""
        ...

    async def record_cancelled(
        self, *, org_id: str, run_id: str, steps: Sequence[StepRecord]
    ) -> None: ...

    async def cancelled_runs(self, run_ids: Sequence[str]) -> list[str]: ...


class RunLeases(Protocol):
    """This process's run leases and the sweeps over runs and confirmations whose
    time ran out (pg/leases.py)."""

    async def renew_leases(self, run_ids: Sequence[str]) -> None: ...

    async def release_leases(self) -> None: ...

    async def recover_stopped_runs(
        self, *, ttl_seconds: float, limit: int = 100
    ) -> list[Recovered]: ...

    async def confirmations_due(self) -> bool:
        """Whether any open confirmation is past its expiry."""
        ...

    async def expire_confirmations(self, *, span_id: str, limit: int = 100) -> list[str]: ...


class ConfirmationStore(RunCancels, RunLeases, Protocol):
    """Confirmed writes, and with them cancels and run ownership (pg/). Each method
    is one transaction; the docstrings there say what each guarantees."""

    async def request_confirmation(
        self,
        *,
        org_id: str,
        run_id: str,
        user_id: str,
        proposal: ConfirmationProposal,
        step: StepRecord,
        loop_state: LoopState,
    ) -> Run: ...

    async def resolve_confirmation(
        self,
        *,
        org_id: str,
        token: str,
        resolver: Resolver,
        decision: Decision,
        note: str,
        span_id: str,
        started_at: datetime,
    ) -> ResolutionRecord: ...

    async def begin_write(self, *, org_id: str, run_id: str, token: str) -> Confirmation: ...

    async def record_write(
        self,
        *,
        org_id: str,
        run_id: str,
        token: str,
        result: dict[str, JSONValue],
        step: StepRecord,
        loop_state: LoopState,
    ) -> bool:
        """True when the run was cancelled while the write was carried out."""
        ...

    async def pending_confirmations(
        self, *, org_id: str, user_id: str | None
    ) -> list[Confirmation]: ...
