"""Where run reservations and provider ceilings are counted, behind one Protocol.

The counts must be shared by every gateway replica, so the real ledger is
PostgreSQL (`postgres.py`); `NoLedger` is for a gateway whose calls carry neither a
run budget nor a ceiling, which then needs no database on the call path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import ChatRequest, check_run_budget


@dataclass(frozen=True, slots=True)
class CeilingGrant:
    """Tokens taken from a provider's ceiling for one call, settled afterwards."""

    provider: str
    bucket_start: int
    tokens: int
    granted: bool
    detail: str = ""
    retry_after_seconds: float | None = None


class Ledger(Protocol):
    async def reserve_run(self, *, org_id: str, request: ChatRequest) -> str | None:
        """Reserve the call's tokens against its run, or raise RunBudgetExceeded.
        None when no run budget applies."""
        ...

    async def release_run(self, reservation_id: str) -> None: ...

    async def begin_call(
        self, *, org_id: str, request: ChatRequest, provider: ProviderConfig | None, tokens: int
    ) -> tuple[str | None, CeilingGrant | None]:
        """reserve_run, then take_ceiling(provider, tokens) for the first attempt
        when one is named, in one round trip where both apply; the ceiling is never
        taken for a call the run refuses."""
        ...

    async def take_ceiling(self, provider: ProviderConfig, tokens: int) -> CeilingGrant | None:
        """None when the provider has no ceiling; otherwise granted or refused."""
        ...

    async def settle_ceiling(self, grant: CeilingGrant, used_tokens: int) -> None:
        """Replace the estimate taken with what the call really used."""
        ...

    async def finish_call(
        self, reservation_id: str | None, grant: CeilingGrant | None, used_tokens: int
    ) -> None:
        """Settle the answering attempt's grant and release the run's reservation at
        once, as an answered call ends (one round trip where both apply)."""
        ...


class NoLedger:
    """Budgets checked per call only, no ceilings: nothing is shared between calls."""

    async def reserve_run(self, *, org_id: str, request: ChatRequest) -> str | None:
        check_run_budget(request)
        return None

    async def release_run(self, reservation_id: str) -> None:
        return None

    async def begin_call(
        self, *, org_id: str, request: ChatRequest, provider: ProviderConfig | None, tokens: int
    ) -> tuple[str | None, CeilingGrant | None]:
        return await self.reserve_run(org_id=org_id, request=request), None

    async def take_ceiling(self, provider: ProviderConfig, tokens: int) -> CeilingGrant | None:
        return None

    async def settle_ceiling(self, grant: CeilingGrant, used_tokens: int) -> None:
        return None

    async def finish_call(
        self, reservation_id: str | None, grant: CeilingGrant | None, used_tokens: int
    ) -> None:
        return None
