"""What can go wrong in the orchestrator, and which gRPC status each cause becomes.

    OrchestratorError (CairnError)
    ├── UnknownAgent             StartRun names no loaded agent spec        INVALID_ARGUMENT
    ├── BadPageToken             ListRuns got a token it never issued       INVALID_ARGUMENT
    ├── AgentSpecInvalid         a spec file is malformed (at start-up)     INVALID_ARGUMENT
    ├── ToolContractViolation    a tool registered against the contract     INTERNAL
    ├── RunNotVisible            a run of someone else, or none at all      PERMISSION_DENIED (I6)
    ├── DependencyFailed         gateway, retrieval or memory call failed   UNAVAILABLE
    ├── StoreUnavailable         the run store (PostgreSQL) failed          UNAVAILABLE
    │   └── RunTakenOver         another orchestrator took the run's lease  UNAVAILABLE
    ├── StoreRefusedValue        PostgreSQL refused a value (not an outage) INVALID_ARGUMENT
    ├── ConfirmationClosed       the confirmation expired or was already    FAILED_PRECONDITION
    │                            decided the other way (or its run was cancelled)
    ├── RunEnded                 CancelRun on a run that has already ended  FAILED_PRECONDITION
    └── RunCancelled             inside the loop only: a person cancelled   FAILED_PRECONDITION
                                 the run this process is working on

A confirmation token that is not the caller's (or not a person's to resolve,
or does not exist) is RunNotVisible: the one denial (I6).

Inside a run most of these never reach the caller: a failed retrieval, memory
read or tool is recorded as a step error (I3, I11), and a failed model call ends
the run FAILED with the reason. Only the request itself (an unknown agent, a
run that is not the caller's) is refused with a status.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cairn_libs.errors import (
    CairnError,
    ConfigurationError,
    Conflict,
    Denied,
    DependencyUnavailable,
    InvalidInput,
)

if TYPE_CHECKING:
    from cairn_orchestrator.domain import StepRecord


class OrchestratorError(CairnError):
    """Base of every orchestrator error."""


class UnknownAgent(OrchestratorError, InvalidInput):
    def __init__(self, agent: str, known: list[str]) -> None:
        listed = ", ".join(repr(name) for name in known) or "none are loaded"
        super().__init__(f"agent {agent!r} is not known; known agents: {listed}")
        self.agent = agent


class BadPageToken(OrchestratorError, InvalidInput):
    def __init__(self, token: str, *, filtered: str = "") -> None:
        issued = (
            f"was not issued by ListRuns for runs in {filtered}"
            if filtered
            else "was not issued by ListRuns"
        )
        super().__init__(
            f"page_token {token[:40]!r} {issued}; pass the next_page_token of the "
            "previous page with the same state filter, or an empty token for the first page"
        )


class AgentSpecInvalid(OrchestratorError, InvalidInput, ConfigurationError):
    """A spec file the orchestrator refuses to load; the message names file and field."""

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(f"{file}: field {field!r}: {problem}")
        self.file = file
        self.field = field


class ToolContractViolation(OrchestratorError):
    """A programming error: a tool that breaks the contract cannot be registered."""


class RunNotVisible(OrchestratorError, Denied):
    """I6: a run that does not exist and a run of someone else read the same."""


class DependencyFailed(OrchestratorError, DependencyUnavailable):
    """A call to gateway, retrieval or memory failed; `status_code` is the gRPC status
    name and `reason` the callee's google.rpc ErrorInfo reason, when it sent one."""

    def __init__(self, service: str, code: str, message: str, *, reason: str = "") -> None:
        super().__init__(f"the {service} service failed ({code}): {message}")
        self.service = service
        self.status_code = code
        self.detail = message
        self.reason = reason


class StoreUnavailable(OrchestratorError, DependencyUnavailable):
    pass


class StoreRefusedValue(OrchestratorError, InvalidInput):
    """PostgreSQL would not take a value of this request; a retry cannot help."""


class RunTakenOver(StoreUnavailable):
    """This orchestrator's lease on a run ran out and another one took the run over;
    whatever this one was doing for it stops without writing anything more."""

    def __init__(self, run_id: str) -> None:
        super().__init__(
            f"run {run_id!r} was taken over by another orchestrator after this one's lease ran out"
        )
        self.run_id = run_id


class ConfirmationClosed(OrchestratorError, Conflict):
    """The confirmation cannot take this decision any more; the message says why."""


class RunEnded(OrchestratorError, Conflict):
    """CancelRun on a run that is no longer RUNNING or CONFIRMATION_PENDING."""

    def __init__(self, run_id: str, state: str) -> None:
        super().__init__(
            f"run {run_id!r} has already ended ({state}); only a RUNNING or "
            "CONFIRMATION_PENDING run can be cancelled"
        )
        self.state = state


class RunCancelled(OrchestratorError, Conflict):
    """A person cancelled the run this process is working on: the loop stops at
    once and writes nothing more but its last words (`steps`, e.g. the model call
    that was cut short), which the store takes only because the run is cancelled."""

    def __init__(self, run_id: str, *, steps: Sequence[StepRecord] = ()) -> None:
        super().__init__(f"run {run_id!r} was cancelled")
        self.run_id = run_id
        self.steps = tuple(steps)
