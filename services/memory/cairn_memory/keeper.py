"""The memory service's operations: apply the domain's rules, read the clock, embed,
and hand the result to the store.

The servicer calls one method per RPC with domain values and the verified call
identity; org and user always come from that identity (I5), the author from
`author_of` (I9). Nothing here knows about protobuf or SQL.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import timedelta
from typing import Final

import structlog
from opentelemetry import trace

from cairn_libs.clock import Clock
from cairn_libs.embedding import Embedder
from cairn_libs.errors import Denied
from cairn_libs.identity import CallIdentity, Principal
from cairn_memory.domain import (
    DEFAULT_TTL,
    Block,
    BlockDraft,
    BlockSearch,
    Erasure,
    HeldAbout,
    HeldQuery,
    Memory,
    ProfileFact,
    PurgeCounts,
    Recalled,
    RecallMode,
    RecallQuery,
    RememberDraft,
    Subject,
    author_of,
    block_number,
    format_block_id,
    may_handle_subject_records,
    new_memory,
    profile_update,
    recall_mode,
)
from cairn_memory.ports import CopyHolders, NoOtherHolders, Store

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)

BACKFILL_BATCH: Final = 256


class MemoryKeeper:
    def __init__(
        self,
        *,
        store: Store,
        embedder: Embedder | None,
        clock: Clock,
        ttl: timedelta = DEFAULT_TTL,
        block_ttl: timedelta | None = None,
        copy_holders: CopyHolders | None = None,
    ) -> None:
        block_ttl = ttl if block_ttl is None else block_ttl
        self._copy_holders = copy_holders or NoOtherHolders()
        if ttl <= timedelta(0):
            raise ValueError(f"memory time-to-live must be positive, got {ttl!r}")
        if block_ttl <= timedelta(0):
            raise ValueError(f"block time-to-live must be positive, got {block_ttl!r}")
        self._block_ttl = block_ttl
        self._store = store
        self._embedder = embedder
        self._clock = clock
        self._ttl = ttl

    @property
    def has_embedder(self) -> bool:
        return self._embedder is not None

    async def _embed(self, text: str) -> list[float]:
        assert self._embedder is not None
        with tracer.start_as_current_span(
            "embeddings", attributes={"gen_ai.request.model": self._embedder.model_id}
        ):
            (vector,) = await self._embedder.embed([text])
        return vector

    async def remember(self, draft: RememberDraft, identity: CallIdentity) -> tuple[Memory, bool]:
        memory = new_memory(
            draft,
            author=author_of(identity),
            now=self._clock.now(),
            ttl=self._ttl,
            memory_id=str(uuid.uuid4()),
        )
        embedding = await self._embed(memory.text) if self._embedder is not None else None
        with tracer.start_as_current_span("memory.remember") as span:
            held, already_held = await self._store.memories.remember(
                memory, org_id=identity.principal.org_id, embedding=embedding
            )
            span.set_attribute("cairn.memory.already_held", already_held)
            span.set_attribute("cairn.memory.author_kind", memory.author.kind.value)
        log.info(
            "memory.remembered",
            memory_id=held.memory_id,
            subject_kind=memory.subject.kind.value,
            author_kind=memory.author.kind.value,
            already_held=already_held,
            superseded=len(memory.supersedes),
        )
        return held, already_held

    async def recall(self, query: RecallQuery, principal: Principal) -> Recalled:
        now = self._clock.now()
        mode, reason = recall_mode(has_embedder=self._embedder is not None, query=query.query)
        with tracer.start_as_current_span(
            "memory.recall",
            attributes={"cairn.memory.recall_mode": mode.value, "cairn.memory.k": query.k},
        ) as span:
            if mode is RecallMode.SEMANTIC:
                vector = await self._embed(query.query)
                memories = await self._store.memories.recall_semantic(
                    org_id=principal.org_id,
                    subject=query.subject,
                    vector=vector,
                    k=query.k,
                    now=now,
                )
            else:
                memories = await self._store.memories.recall_newest(
                    org_id=principal.org_id, subject=query.subject, k=query.k, now=now
                )
            profile: list[ProfileFact] = []
            if query.include_profile and query.subject is not None:
                profile = await self._store.profiles.current_profile(
                    org_id=principal.org_id, subject=query.subject, now=now
                )
            span.set_attribute("cairn.memory.returned", len(memories))
        sealed = sum(1 for m in memories if not m.readable)
        if sealed:
            reason += (
                f"; {sealed} of these memories are encrypted and this deployment holds no key, "
                "so their text is withheld"
            )
        return Recalled(
            memories=tuple(memories), mode=mode, mode_reason=reason, profile=tuple(profile)
        )

    async def held(self, query: HeldQuery, principal: Principal) -> HeldAbout:
        _require_subject_access(query.subject, principal)
        with tracer.start_as_current_span("memory.held"):
            return await self._store.subjects.held(
                query, org_id=principal.org_id, now=self._clock.now()
            )

    async def forget(self, subject: Subject, principal: Principal, *, caller_token: str) -> Erasure:
        """Erase everything held about `subject` here, then every copy elsewhere (I9).

        The erasure here is kept even when a holder of copies cannot be reached; the
        caller is then told to Forget again, which erases nothing twice and reaches
        the copies it missed.
        """
        _require_subject_access(subject, principal)
        with tracer.start_as_current_span("memory.forget"):
            erasure, erasure_id = await self._store.subjects.forget(
                org_id=principal.org_id,
                subject=subject,
                erased_by=principal.user_id,
                now=self._clock.now(),
            )
            log.info(
                "memory.erased",
                subject_kind=subject.kind.value,
                memories_erased=erasure.memories_erased,
                facts_erased=erasure.facts_erased,
                blocks_erased=erasure.blocks_erased,
            )
            await self._copy_holders.forget_copies(subject, caller_token=caller_token)
            await self._store.subjects.mark_copies_erased(
                org_id=principal.org_id, erasure_id=erasure_id
            )
        return replace(erasure, copies_erased=True)

    async def close(self) -> None:
        await self._copy_holders.close()

    async def update_profile(
        self,
        *,
        subject: Subject,
        fact_key: str,
        value: str,
        previous_value: str | None,
        identity: CallIdentity,
    ) -> ProfileFact:
        update = profile_update(
            subject=subject,
            fact_key=fact_key,
            value=value,
            previous_value=previous_value,
            author=author_of(identity),
            now=self._clock.now(),
            ttl=self._ttl,
        )
        with tracer.start_as_current_span("memory.update_profile"):
            return await self._store.profiles.update_profile(
                update, org_id=identity.principal.org_id
            )

    async def archive(self, draft: BlockDraft, principal: Principal) -> str:
        with tracer.start_as_current_span("memory.archive"):
            now = self._clock.now()
            number = await self._store.blocks.archive(
                draft,
                org_id=principal.org_id,
                user_id=principal.user_id,
                now=now,
                expires_at=now + self._block_ttl,
            )
        if number is None:
            # The conversation is someone else's: the one denial, nothing kept.
            raise Denied()
        return format_block_id(number)

    async def recall_block(self, raw_block_id: str, principal: Principal) -> Block:
        number = block_number(raw_block_id)
        with tracer.start_as_current_span("memory.recall_block"):
            block = await self._store.blocks.recall_block(
                org_id=principal.org_id,
                user_id=principal.user_id,
                number=number,
                now=self._clock.now(),
            )
        if block is None:
            raise Denied()
        return block

    async def search_blocks(self, search: BlockSearch, principal: Principal) -> list[Block]:
        with tracer.start_as_current_span("memory.search_blocks"):
            if (
                search.conversation_id is not None
                and not await self._store.blocks.owns_conversation(
                    org_id=principal.org_id,
                    user_id=principal.user_id,
                    conversation_id=search.conversation_id,
                )
            ):
                raise Denied()
            return await self._store.blocks.search_blocks(
                search, org_id=principal.org_id, user_id=principal.user_id, now=self._clock.now()
            )

    async def purge_expired(self) -> PurgeCounts:
        with tracer.start_as_current_span("memory.purge"):
            counts = await self._store.purge_expired(now=self._clock.now())
        if counts.memories or counts.fact_versions or counts.blocks:
            log.info(
                "memory.purged",
                memories=counts.memories,
                fact_versions=counts.fact_versions,
                blocks=counts.blocks,
            )
        return counts

    async def backfill_embeddings(self) -> int:
        """Embed active memories kept while no embedder was configured, so SEMANTIC
        recall can find them once one is. Returns how many were embedded."""
        if self._embedder is None:
            return 0
        pending = await self._store.memories.memories_without_embedding(
            limit=BACKFILL_BATCH, now=self._clock.now()
        )
        if not pending:
            return 0
        with tracer.start_as_current_span("memory.backfill_embeddings"):
            vectors = await self._embedder.embed([text for _, _, text in pending])
            await self._store.memories.set_embeddings(
                [(org, mid, vec) for (org, mid, _), vec in zip(pending, vectors, strict=True)]
            )
        log.info("memory.embeddings_backfilled", count=len(pending))
        return len(pending)


def _require_subject_access(subject: Subject, principal: Principal) -> None:
    if not may_handle_subject_records(subject, user_id=principal.user_id, roles=principal.roles):
        raise Denied()
