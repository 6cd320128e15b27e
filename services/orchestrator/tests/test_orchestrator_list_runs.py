"""ListRuns narrowed to one state, page by page, against the real store: only runs
in that state, newest first, every one exactly once across pages; a page token
is bound to the filter it was issued under, so a token of another listing is
INVALID_ARGUMENT rather than a page of the wrong runs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn_libs.db import Database
from cairn_libs.errors import InvalidInput
from cairn_libs.identity import Principal
from cairn_orchestrator.domain import Run, RunState
from cairn_orchestrator.errors import BadPageToken
from cairn_orchestrator.postgres import SCHEMA, migrations
from cairn_orchestrator.servicer import run_state_from_proto
from cairn_orchestrator.testing import ScriptedGateway, answer, tool_calls
from services.orchestrator.tests.test_orchestrator_confirmations import Harness

NOTE = ("note", '{"text":"likes tea"}')


@pytest.fixture(scope="module")
async def database(pg_url: str) -> AsyncIterator[Database]:
    db = Database(url=pg_url, schema=SCHEMA, migrations=migrations())
    assert await db.ready()
    yield db
    await db.close()


async def _runs(harness: Harness, *, completed: int, pending: int) -> dict[RunState, list[str]]:
    """Runs of both states, interleaved in time, returned newest first per state."""
    made: dict[RunState, list[str]] = {RunState.COMPLETED: [], RunState.CONFIRMATION_PENDING: []}
    for i in range(max(completed, pending)):
        if i < completed:
            harness.gateway.replies.append(answer(f"Answer {i}."))
            run = await harness.ask()
            made[run.state].append(run.run_id)
        if i < pending:
            harness.gateway.replies.append(tool_calls(NOTE))
            run = await harness.ask()
            made[run.state].append(run.run_id)
    return {state: list(reversed(ids)) for state, ids in made.items()}


async def _all_pages(harness: Harness, state: RunState | None, size: int) -> list[Run]:
    seen: list[Run] = []
    token = ""
    while True:
        page = await harness.orchestrator.list_runs(
            harness.alice.principal, requested_size=size, page_token=token, state=state
        )
        seen.extend(page.runs)
        token = page.next_page_token
        if not token:
            return seen


async def test_a_state_filter_lists_only_that_states_runs_newest_first_across_pages(
    database: Database, new_org: str
) -> None:
    harness = Harness(database, ScriptedGateway([]), new_org)
    made = await _runs(harness, completed=3, pending=2)

    completed = await _all_pages(harness, RunState.COMPLETED, 2)
    assert [r.run_id for r in completed] == made[RunState.COMPLETED]
    assert {r.state for r in completed} == {RunState.COMPLETED}
    pending = await _all_pages(harness, RunState.CONFIRMATION_PENDING, 1)
    assert [r.run_id for r in pending] == made[RunState.CONFIRMATION_PENDING]
    assert all(r.pending_confirmation is not None for r in pending)
    assert await _all_pages(harness, RunState.CANCELLED, 2) == []
    everything = await _all_pages(harness, None, 2)
    assert len(everything) == 5


async def test_the_filter_narrows_an_admins_org_wide_listing_too(
    database: Database, new_org: str
) -> None:
    harness = Harness(database, ScriptedGateway([]), new_org)
    made = await _runs(harness, completed=1, pending=1)
    admin = Principal(org_id=new_org, user_id="root", roles=("admin",))
    page = await harness.orchestrator.list_runs(
        admin, requested_size=10, page_token="", state=RunState.CONFIRMATION_PENDING
    )
    assert [r.run_id for r in page.runs] == made[RunState.CONFIRMATION_PENDING]
    bob = Principal(org_id=new_org, user_id="bob")
    nobody = await harness.orchestrator.list_runs(
        bob, requested_size=10, page_token="", state=RunState.CONFIRMATION_PENDING
    )
    assert nobody.runs == ()


async def test_a_page_token_is_refused_under_any_filter_but_the_one_it_was_issued_for(
    database: Database, new_org: str
) -> None:
    harness = Harness(database, ScriptedGateway([]), new_org)
    await _runs(harness, completed=3, pending=3)
    principal = harness.alice.principal

    async def token_for(state: RunState | None) -> str:
        page = await harness.orchestrator.list_runs(
            principal, requested_size=1, page_token="", state=state
        )
        assert page.next_page_token
        return page.next_page_token

    completed_token = await token_for(RunState.COMPLETED)
    unfiltered_token = await token_for(None)
    with pytest.raises(BadPageToken, match="for runs in CONFIRMATION_PENDING"):
        await harness.orchestrator.list_runs(
            principal,
            requested_size=1,
            page_token=completed_token,
            state=RunState.CONFIRMATION_PENDING,
        )
    with pytest.raises(BadPageToken, match="for runs in every state"):
        await harness.orchestrator.list_runs(
            principal, requested_size=1, page_token=completed_token
        )
    with pytest.raises(BadPageToken, match="for runs in COMPLETED"):
        await harness.orchestrator.list_runs(
            principal, requested_size=1, page_token=unfiltered_token, state=RunState.COMPLETED
        )
    # Under its own filter it goes on where it stopped.
    second = await harness.orchestrator.list_runs(
        principal, requested_size=1, page_token=completed_token, state=RunState.COMPLETED
    )
    assert [r.state for r in second.runs] == [RunState.COMPLETED]


def test_the_proto_filter_maps_every_state_and_refuses_numbers_the_schema_lacks() -> None:
    assert run_state_from_proto(pb.RUN_STATE_UNSPECIFIED) is None
    for state in RunState:
        assert run_state_from_proto(pb.RunState.Value(f"RUN_STATE_{state.value}")) is state
    with pytest.raises(InvalidInput, match=r"state 99 \(not a value the schema defines\)"):
        run_state_from_proto(99)
