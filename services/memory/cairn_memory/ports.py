"""What the keeper needs of storage, one Protocol per concern, and of the other
holders of a subject's copies. postgres.PostgresStore and copies.OrchestratorCopies
are the implementations; a test may hand the keeper anything of these shapes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

from cairn_memory.domain import (
    Block,
    BlockDraft,
    BlockSearch,
    Erasure,
    HeldAbout,
    HeldQuery,
    Memory,
    NewMemory,
    ProfileFact,
    ProfileUpdate,
    PurgeCounts,
    Subject,
)


class MemoryRecords(Protocol):
    async def remember(
        self, memory: NewMemory, *, org_id: str, embedding: Sequence[float] | None
    ) -> tuple[Memory, bool]: ...

    async def recall_semantic(
        self,
        *,
        org_id: str,
        subject: Subject | None,
        vector: Sequence[float],
        k: int,
        now: datetime,
    ) -> list[Memory]: ...

    async def recall_newest(
        self, *, org_id: str, subject: Subject | None, k: int, now: datetime
    ) -> list[Memory]: ...

    async def memories_without_embedding(
        self, *, limit: int, now: datetime
    ) -> list[tuple[str, str, str]]: ...

    async def set_embeddings(
        self, embeddings: Sequence[tuple[str, str, Sequence[float]]]
    ) -> None: ...


class ProfileRecords(Protocol):
    async def current_profile(
        self, *, org_id: str, subject: Subject, now: datetime
    ) -> list[ProfileFact]: ...

    async def update_profile(self, update: ProfileUpdate, *, org_id: str) -> ProfileFact: ...


class BlockRecords(Protocol):
    async def archive(
        self,
        draft: BlockDraft,
        *,
        org_id: str,
        user_id: str,
        now: datetime,
        expires_at: datetime,
    ) -> int | None: ...

    async def recall_block(
        self, *, org_id: str, user_id: str, number: int, now: datetime
    ) -> Block | None: ...

    async def owns_conversation(
        self, *, org_id: str, user_id: str, conversation_id: str
    ) -> bool: ...

    async def search_blocks(
        self, search: BlockSearch, *, org_id: str, user_id: str, now: datetime
    ) -> list[Block]: ...


class SubjectRecords(Protocol):
    async def held(self, query: HeldQuery, *, org_id: str, now: datetime) -> HeldAbout: ...

    async def forget(
        self, *, org_id: str, subject: Subject, erased_by: str, now: datetime
    ) -> tuple[Erasure, int]: ...

    async def mark_copies_erased(self, *, org_id: str, erasure_id: int) -> None: ...


class Store(Protocol):
    @property
    def memories(self) -> MemoryRecords: ...

    @property
    def profiles(self) -> ProfileRecords: ...

    @property
    def blocks(self) -> BlockRecords: ...

    @property
    def subjects(self) -> SubjectRecords: ...

    async def ready(self) -> bool: ...

    async def purge_expired(self, *, now: datetime) -> PurgeCounts: ...


class CopyHolders(Protocol):
    """Every other place copies of a subject's text may be kept."""

    async def forget_copies(self, subject: Subject, *, caller_token: str) -> None:
        """Erase them; raises CopiesUnreachable when a holder did not confirm."""
        ...

    async def close(self) -> None: ...


class NoOtherHolders:
    """A deployment without an orchestrator: memory holds the only copies."""

    async def forget_copies(self, subject: Subject, *, caller_token: str) -> None:
        return None

    async def close(self) -> None:
        return None
