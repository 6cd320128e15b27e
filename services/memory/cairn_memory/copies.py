"""Where else an erased subject's text may be held, and how Forget reaches it.

The orchestrator keeps what its runs read and proposed about a subject (memories,
profile facts and blocks in run state, steps, answers and confirmations). Forget
erases here first, then asks every holder to erase its copies with the caller's own
token: the holder checks the same right to erase (I9), so nobody erases through it
what they could not erase with Forget.

Why Forget calls out rather than holders polling a feed of erasures: a poll leaves
the copies readable until it runs, and an erasure a person was told is done must be
done when they are told. A holder that cannot be reached makes Forget answer
UNAVAILABLE after the erasure here is kept; calling Forget again finishes the rest.
"""

from __future__ import annotations

import grpc

from cairn.memory.v1 import memory_pb2
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_memory.domain import Subject
from cairn_memory.errors import CopiesUnreachable


class OrchestratorCopies:
    """The orchestrator's copies, erased through its ForgetCopies RPC (a ports.CopyHolders)."""

    def __init__(self, address: str, *, timeout_seconds: float = 15.0) -> None:
        self._address = address
        self._timeout = timeout_seconds
        # Made on first use: an aio channel belongs to the event loop that serves.
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> orchestrator_pb2_grpc.OrchestratorServiceAsyncStub:
        if self._channel is None:
            self._channel = channel(self._address)
        return orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)

    async def forget_copies(self, subject: Subject, *, caller_token: str) -> None:
        request = orchestrator_pb2.ForgetCopiesRequest(
            subject=memory_pb2.Subject(
                kind=memory_pb2.SubjectKind.Value(f"SUBJECT_KIND_{subject.kind.value}"),
                id=subject.id,
            )
        )
        try:
            await self._stub().ForgetCopies(
                request, metadata=call_metadata(caller_token), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise CopiesUnreachable(
                "the subject's memories, facts and archived blocks are erased, but the "
                f"orchestrator at {self._address} did not erase its copies "
                f"({exc.code().name}); call Forget again to finish"
            ) from exc

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None
