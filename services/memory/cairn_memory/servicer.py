"""cairn.memory.v1.MemoryService over gRPC: proto in, proto out.

Each method reads the verified identity, converts the request at the door
(cairn_memory.convert), calls the keeper, and converts the answer back.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn_libs.server import current_caller_token, current_identity
from cairn_memory.convert import (
    block_to_proto,
    erasure_to_proto,
    fact_to_proto,
    memory_to_proto,
    optional_subject_from_proto,
    recall_mode_to_proto,
    remember_draft_from_proto,
    subject_from_proto,
)
from cairn_memory.domain import (
    block_draft,
    block_search,
    format_page_token,
    held_query,
    recall_query,
    refuse_secrets_in_block,
)
from cairn_memory.keeper import MemoryKeeper

SERVICE_NAME = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].full_name


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    def __init__(self, keeper: MemoryKeeper) -> None:
        self._keeper = keeper

    async def Remember(
        self, request: memory_pb2.RememberRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> memory_pb2.RememberResponse:
        memory, already_held = await self._keeper.remember(
            remember_draft_from_proto(request), current_identity()
        )
        return memory_pb2.RememberResponse(
            memory=memory_to_proto(memory), already_held=already_held
        )

    async def UpdateProfile(
        self, request: memory_pb2.UpdateProfileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> memory_pb2.UpdateProfileResponse:
        fact = await self._keeper.update_profile(
            subject=subject_from_proto(request.subject),
            fact_key=request.fact_key,
            value=request.value,
            previous_value=request.previous_value if request.HasField("previous_value") else None,
            identity=current_identity(),
        )
        return memory_pb2.UpdateProfileResponse(fact=fact_to_proto(fact))

    async def Recall(
        self, request: memory_pb2.RecallRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> memory_pb2.RecallResponse:
        principal = current_identity().principal
        query = recall_query(
            query=request.query,
            subject=optional_subject_from_proto(request),
            k=request.k,
            include_profile=request.include_profile,
        )
        recalled = await self._keeper.recall(query, principal)
        return memory_pb2.RecallResponse(
            memories=[memory_to_proto(m) for m in recalled.memories],
            mode=recall_mode_to_proto(recalled.mode),
            mode_reason=recalled.mode_reason,
            profile=[fact_to_proto(f) for f in recalled.profile],
        )

    async def Held(
        self, request: memory_pb2.HeldRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> memory_pb2.HeldResponse:
        principal = current_identity().principal
        query = held_query(
            subject_from_proto(request.subject),
            page_size=request.page_size,
            page_token=request.page_token,
            org_id=principal.org_id,
        )
        held = await self._keeper.held(query, principal)
        return memory_pb2.HeldResponse(
            memories=[memory_to_proto(m) for m in held.memories],
            profile=[fact_to_proto(f) for f in held.profile],
            erasures=[erasure_to_proto(e) for e in held.erasures],
            next_page_token=format_page_token(held.next_page) if held.next_page else "",
        )

    async def Forget(
        self, request: memory_pb2.ForgetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> memory_pb2.ForgetResponse:
        erasure = await self._keeper.forget(
            subject_from_proto(request.subject),
            current_identity().principal,
            caller_token=current_caller_token(),
        )
        return memory_pb2.ForgetResponse(erasure=erasure_to_proto(erasure))

    async def Archive(
        self, request: memory_pb2.ArchiveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> memory_pb2.ArchiveResponse:
        # Sizes and shapes first (cheap), so a hostile 4 MB body is refused before it
        # is scanned; the scan of a large block (most of a second of CPU at the limit)
        # runs in a worker thread so other calls keep being served meanwhile.
        draft = block_draft(
            label=request.label,
            role=request.role,
            content=request.content,
            conversation_id=request.conversation_id,
            subjects=[
                subject_from_proto(about, field_name=f"subjects[{index}]")
                for index, about in enumerate(request.subjects)
            ],
            archived_by=current_identity().principal.user_id,
        )
        await asyncio.to_thread(
            refuse_secrets_in_block,
            label=request.label,
            role=request.role,
            content=request.content,
            conversation_id=request.conversation_id,
        )
        block_id = await self._keeper.archive(draft, current_identity().principal)
        return memory_pb2.ArchiveResponse(block_id=block_id)

    async def RecallBlock(
        self, request: memory_pb2.RecallBlockRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> memory_pb2.RecallBlockResponse:
        block = await self._keeper.recall_block(request.block_id, current_identity().principal)
        return memory_pb2.RecallBlockResponse(block=block_to_proto(block))

    async def SearchBlocks(
        self, request: memory_pb2.SearchBlocksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> memory_pb2.SearchBlocksResponse:
        search = block_search(
            query=request.query, limit=request.limit, conversation_id=request.conversation_id
        )
        blocks = await self._keeper.search_blocks(search, current_identity().principal)
        return memory_pb2.SearchBlocksResponse(blocks=[block_to_proto(b) for b in blocks])
