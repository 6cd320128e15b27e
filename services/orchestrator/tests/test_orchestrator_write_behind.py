"""Step writes go on behind the run: the next step begins while the previous one's
write is still in flight (it does not need it), the writes stay in order, and the
run ends only once every step is stored. A held store proves the overlap: each
write waits for the step after it to have begun."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from cairn_orchestrator.domain import (
    ConversationTurn,
    LoopState,
    RunState,
    Step,
    StepRecord,
)
from cairn_orchestrator.errors import StoreUnavailable
from cairn_orchestrator.loop import RunLoop
from cairn_orchestrator.run_scope import Caller
from cairn_orchestrator.testing import (
    ALICE,
    FakeClock,
    FakeMemory,
    FakeRetrieval,
    MemoryRunStore,
    ScriptedGateway,
    answer,
    chunk,
    handbook_spec,
    memory,
    tool_calls,
)
from cairn_orchestrator.tools import Tool, ToolContext, ToolRegistry, ToolResult

CALLER = Caller(principal=ALICE, token="alice-own-token")
WAIT_SECONDS = 10.0


class HeldStore(MemoryRunStore):
    """Holds the n-th step write until the event `release[n]` is set (or a deadline
    passes), and notes whether it was; `fail_write` fails that write."""

    def __init__(self, clock: FakeClock, *, fail_write: int | None = None) -> None:
        super().__init__(clock)
        self.clock = clock
        self.release: dict[int, asyncio.Event] = {}
        self.overlapped: dict[int, bool] = {}
        self.writes = 0
        self.fail_write = fail_write

    async def record_steps(
        self,
        *,
        org_id: str,
        run_id: str,
        steps: Sequence[StepRecord],
        loop_state: LoopState | None,
    ) -> list[Step]:
        self.writes += 1
        n = self.writes
        if n in self.release:
            try:
                await asyncio.wait_for(self.release[n].wait(), WAIT_SECONDS)
                self.overlapped[n] = True
            except TimeoutError:
                self.overlapped[n] = False
        if n == self.fail_write:
            raise StoreUnavailable("the run store is unavailable (held test store)")
        return await super().record_steps(
            org_id=org_id, run_id=run_id, steps=steps, loop_state=loop_state
        )


def loop_with(store: HeldStore, gateway: ScriptedGateway, on_tool: asyncio.Event) -> RunLoop:
    registry = ToolRegistry()

    async def look(arguments: Mapping[str, Any], context: ToolContext) -> ToolResult:
        on_tool.set()
        return ToolResult(content={"found": "nothing more"})

    registry.register(
        Tool(
            name="look",
            description="Looks.",
            parameters={"type": "object"},
            effect="read",
            handler=look,
        )
    )
    return RunLoop(
        store=store,
        gateway=gateway,
        retrieval=FakeRetrieval(results=[chunk(1)]),
        memory=FakeMemory(memories=[memory(1)]),
        registry=registry,
        mint_actor_token=lambda run_id, agent: f"actor-token-for-{run_id}",
        clock=store.clock,
    )


async def test_the_model_call_and_the_tools_begin_while_the_previous_steps_are_being_stored() -> (
    None
):
    model_called, tool_ran = asyncio.Event(), asyncio.Event()
    store = HeldStore(FakeClock())
    # Write 1 (the opening steps) is held until the model is called; write 2 (the
    # model call that asked for a tool) until the tool has run.
    store.release = {1: model_called, 2: tool_ran}
    gateway = ScriptedGateway(
        [tool_calls(("look", "{}")), answer("Sixteen weeks [S1].")], on_call=model_called.set
    )
    loop = loop_with(store, gateway, tool_ran)

    run = await loop.start(
        spec=handbook_spec(tools=("look",)),
        caller=CALLER,
        question="How much parental leave?",
        conversation_id="conv-1",
        earlier=[ConversationTurn("user", "hello")],
    )

    assert run.state is RunState.COMPLETED, run.reason
    assert store.overlapped == {1: True, 2: True}
    # Every step stored, in the order it happened, before the run was seen ended.
    steps = store.runs[run.run_id].steps
    assert [(s.seq, s.kind.value) for s in steps] == [
        (1, "MEMORY_READ"),
        (2, "RETRIEVAL"),
        (3, "MODEL_CALL"),
        (4, "TOOL_CALL"),
        (5, "MODEL_CALL"),
    ]


async def test_a_step_write_that_fails_behind_the_run_still_ends_it_with_the_true_reason() -> None:
    model_called, tool_ran = asyncio.Event(), asyncio.Event()
    store = HeldStore(FakeClock(), fail_write=1)
    gateway = ScriptedGateway(
        [tool_calls(("look", "{}")), answer("Sixteen weeks [S1].")], on_call=model_called.set
    )
    loop = loop_with(store, gateway, tool_ran)

    try:
        await loop.start(
            spec=handbook_spec(tools=("look",)),
            caller=CALLER,
            question="How much parental leave?",
            conversation_id="conv-1",
            earlier=[],
        )
    except StoreUnavailable:
        pass
    else:
        raise AssertionError("a run whose step write failed answered as if stored")
    (run_id,) = store.runs
    # Nothing was written past the gap, and the run waits to be ended with the reason.
    assert store.runs[run_id].steps == []
    assert loop.active_run_ids() == (run_id,)
    (ended,) = await loop.settle_unsettled()
    assert ended == run_id
    stored = store.runs[run_id].run
    assert stored.state is RunState.FAILED and "stopped answering" in stored.reason


class HeldCreateStore(HeldStore):
    """Writes the run's row only once recall has begun (or a deadline passes)."""

    def __init__(self, clock: FakeClock, recall_started: asyncio.Event) -> None:
        super().__init__(clock)
        self.recall_started = recall_started
        self.create_saw_recall: bool | None = None

    async def create_run(self, **fields: Any) -> Any:
        try:
            await asyncio.wait_for(self.recall_started.wait(), WAIT_SECONDS)
            self.create_saw_recall = True
        except TimeoutError:
            self.create_saw_recall = False
        return await super().create_run(**fields)


class NoticedMemory(FakeMemory):
    def __init__(self, started: asyncio.Event) -> None:
        super().__init__(memories=[memory(1)])
        self.started = started

    async def recall(self, **arguments: Any) -> Any:
        self.started.set()
        return await super().recall(**arguments)


async def test_recall_and_the_prefetch_begin_while_the_runs_row_is_being_written() -> None:
    recall_started = asyncio.Event()
    store = HeldCreateStore(FakeClock(), recall_started)
    loop = RunLoop(
        store=store,
        gateway=ScriptedGateway([answer("Sixteen weeks [S1].")]),
        retrieval=FakeRetrieval(results=[chunk(1)]),
        memory=NoticedMemory(recall_started),
        registry=ToolRegistry(),
        mint_actor_token=lambda run_id, agent: f"actor-token-for-{run_id}",
        clock=store.clock,
    )

    run = await loop.start(
        spec=handbook_spec(tools=()),
        caller=CALLER,
        question="How much parental leave?",
        conversation_id="conv-1",
        earlier=[],
    )

    assert run.state is RunState.COMPLETED, run.reason
    assert store.create_saw_recall is True
    kinds = [s.kind.value for s in store.runs[run.run_id].steps]
    assert kinds == ["MEMORY_READ", "RETRIEVAL", "MODEL_CALL"]


async def test_a_run_the_store_cannot_create_is_refused_and_its_reads_are_stopped() -> None:
    class DownStore(MemoryRunStore):
        async def create_run(self, **fields: Any) -> Any:
            raise StoreUnavailable("the run store is unavailable (test)")

    clock = FakeClock()
    loop = RunLoop(
        store=DownStore(clock),
        gateway=ScriptedGateway([]),
        retrieval=FakeRetrieval(results=[chunk(1)]),
        memory=FakeMemory(memories=[memory(1)]),
        registry=ToolRegistry(),
        mint_actor_token=lambda run_id, agent: f"actor-token-for-{run_id}",
        clock=clock,
    )
    try:
        await loop.start(
            spec=handbook_spec(tools=()),
            caller=CALLER,
            question="How much parental leave?",
            conversation_id="conv-1",
            earlier=[],
        )
    except StoreUnavailable as exc:
        assert "unavailable" in exc.message
    else:
        raise AssertionError("a run the store could not create was answered")
    assert loop.active_run_ids() == ()
