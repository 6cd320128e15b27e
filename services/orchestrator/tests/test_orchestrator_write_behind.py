"""Step writes go on behind the run: the next step begins while the previous one's
write is still in flight (it does not need it), the writes stay in order, and the
run ends only once every step is stored. A held store proves the overlap: each
write waits for the step after it to have begun. One write is in flight at a
time: the steps recorded meanwhile go together in the next statement, or in the
one that ends the run."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from cairn_libs.clock import FakeClock
from cairn_orchestrator.domain import (
    CallCredentials,
    ConversationTurn,
    LoopState,
    Run,
    RunState,
    Step,
    StepKind,
    StepRecord,
)
from cairn_orchestrator.errors import RunCancelled, StoreUnavailable
from cairn_orchestrator.events import RunSignals
from cairn_orchestrator.loop import RunLoop
from cairn_orchestrator.recording import StepRecorder
from cairn_orchestrator.run_scope import Caller, RunClock, RunScope
from cairn_orchestrator.testing import (
    ALICE,
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
CALLER_CREDENTIALS = CallCredentials(caller_token="alice-own-token", actor_token="actor-token")
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
        # Per statement, the kinds of the steps it stored (a run's end: "end").
        self.statements: list[tuple[str, list[str]]] = []
        self.ending = False

    async def record_steps(
        self,
        *,
        org_id: str,
        run_id: str,
        steps: Sequence[StepRecord],
        loop_state: LoopState | None,
    ) -> list[Step]:
        if self.ending:  # the run's end stores its steps through here too
            return await super().record_steps(
                org_id=org_id, run_id=run_id, steps=steps, loop_state=loop_state
            )
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
        self.statements.append(("steps", [s.kind.value for s in steps]))
        return await super().record_steps(
            org_id=org_id, run_id=run_id, steps=steps, loop_state=loop_state
        )

    async def finish_run(self, **fields: Any) -> Any:
        self.statements.append(("end", [s.kind.value for s in fields.get("steps", ())]))
        self.ending = True
        try:
            return await super().finish_run(**fields)
        finally:
            self.ending = False


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


async def test_steps_recorded_while_a_write_is_in_flight_go_in_one_statement_with_the_runs_end() -> (
    None
):
    second_call, tool_ran = asyncio.Event(), asyncio.Event()
    calls = 0

    def on_call() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            second_call.set()

    store = HeldStore(FakeClock())
    # The opening steps' write stays in flight until the model is asked the second
    # time: the model call that asked for a tool, and the tool call, are recorded
    # meanwhile, and the run ends while they wait.
    store.release = {1: second_call}
    gateway = ScriptedGateway(
        [tool_calls(("look", "{}")), answer("Sixteen weeks [S1].")], on_call=on_call
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
    assert store.overlapped == {1: True}
    # Two statements, not four: the steps that waited went with the run's end.
    assert store.statements == [
        ("steps", ["MEMORY_READ", "RETRIEVAL"]),
        ("end", ["MODEL_CALL", "TOOL_CALL", "MODEL_CALL"]),
    ]
    stored = store.runs[run.run_id]
    assert [(s.seq, s.kind.value) for s in stored.steps] == [
        (1, "MEMORY_READ"),
        (2, "RETRIEVAL"),
        (3, "MODEL_CALL"),
        (4, "TOOL_CALL"),
        (5, "MODEL_CALL"),
    ]
    assert stored.loop_state is not None and stored.loop_state.next_phase == "finished"


class CancelledStore(MemoryRunStore):
    """Refuses, as a cancelled run's store does, the write `refuse` (1: the first
    step write, 0: the run's end), the first write only once `release` is set."""

    def __init__(self, clock: FakeClock, *, refuse: int) -> None:
        super().__init__(clock)
        self.release = asyncio.Event()
        self.began = asyncio.Event()
        self.refuse = refuse

    async def record_steps(
        self,
        *,
        org_id: str,
        run_id: str,
        steps: Sequence[StepRecord],
        loop_state: LoopState | None,
    ) -> list[Step]:
        self.began.set()
        await asyncio.wait_for(self.release.wait(), WAIT_SECONDS)
        if self.refuse == 1:
            raise RunCancelled(run_id)
        return await super().record_steps(
            org_id=org_id, run_id=run_id, steps=steps, loop_state=loop_state
        )

    async def finish_run(self, **fields: Any) -> Any:
        raise RunCancelled(fields["run_id"])


def _record(name: str) -> StepRecord:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    return StepRecord(
        kind=StepKind.TOOL_CALL,
        name=name,
        span_id="0" * 16,
        started_at=at,
        finished_at=at,
        detail={},
    )


async def _recorder_and_scope(
    store: MemoryRunStore, clock: FakeClock
) -> tuple[StepRecorder, RunScope]:
    run: Run = await store.create_run(
        run_id="run-1",
        org_id=ALICE.org_id,
        user_id=ALICE.user_id,
        agent="handbook",
        input="How much parental leave?",
        conversation_id="conv-1",
        earlier_turns=(),
        trace_id="0" * 32,
    )
    recorder = StepRecorder(
        store=store, signals=RunSignals(), clock=RunClock(clock, dependency_timeout_seconds=15)
    )
    scope = RunScope(
        run=run,
        spec=handbook_spec(),
        principal=ALICE,
        credentials=CALLER_CREDENTIALS,
        started=clock.now(),
    )
    return recorder, scope


@pytest.mark.parametrize("refused", [1, 0], ids=["write in flight", "run's end"])
async def test_steps_that_waited_behind_a_statement_a_cancel_refused_are_the_runs_last_steps(
    refused: int,
) -> None:
    clock = FakeClock()
    store = CancelledStore(clock, refuse=refused)
    recorder, scope = await _recorder_and_scope(store, clock)

    await recorder.record(scope, _record("first"), None)
    await asyncio.wait_for(store.began.wait(), WAIT_SECONDS)  # "first" is in flight
    await recorder.record(scope, _record("second"), None)
    await recorder.record_many(scope, (_record("third"), _record("fourth")), None)
    store.release.set()
    with pytest.raises(RunCancelled) as cancelled:
        await recorder.finish(scope, RunState.COMPLETED, None, steps=(_record("answer"),))

    # Nothing is lost: a step is stored, or it is among the run's last steps.
    stored = [s.name for s in store.runs["run-1"].steps]
    last = [s.name for s in cancelled.value.steps]
    assert stored + last == ["first", "second", "third", "fourth"]
    assert stored == ([] if refused == 1 else ["first"])


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
