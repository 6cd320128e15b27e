"""Every orchestrator error becomes the status its docstring tree promises."""

from __future__ import annotations

import grpc
import pytest

from cairn_libs.errors import DENIAL_MESSAGE
from cairn_libs.server import to_rpc_status
from cairn_orchestrator import errors

CASES = [
    (errors.UnknownAgent("helpdesk", ["handbook"]), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.BadPageToken("zzz"), grpc.StatusCode.INVALID_ARGUMENT),
    (
        errors.AgentSpecInvalid("agents/x.yaml", "tier", "'huge' is not one of fast"),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (errors.ToolContractViolation("no card"), grpc.StatusCode.INTERNAL),
    (errors.RunNotVisible(), grpc.StatusCode.PERMISSION_DENIED),
    (errors.DependencyFailed("gateway", "UNAVAILABLE", "down"), grpc.StatusCode.UNAVAILABLE),
    (errors.StoreUnavailable("down"), grpc.StatusCode.UNAVAILABLE),
    (errors.RunTakenOver("run_1"), grpc.StatusCode.UNAVAILABLE),
    (errors.StoreRefusedValue("refused"), grpc.StatusCode.INVALID_ARGUMENT),
    (
        errors.ConfirmationClosed("the confirmation expired"),
        grpc.StatusCode.FAILED_PRECONDITION,
    ),
    (errors.RunEnded("run_1", "COMPLETED"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.RunCancelled("run_1"), grpc.StatusCode.FAILED_PRECONDITION),
]


def test_every_orchestrator_error_class_is_covered() -> None:
    def leaves(cls: type) -> set[type]:
        return {cls} | {sub for child in cls.__subclasses__() for sub in leaves(child)}

    assert leaves(errors.OrchestratorError) - {errors.OrchestratorError} == {
        type(e) for e, _ in CASES
    }


@pytest.mark.parametrize(("error", "code"), CASES, ids=[type(e).__name__ for e, _ in CASES])
def test_each_orchestrator_error_maps_to_its_status(
    error: errors.OrchestratorError, code: grpc.StatusCode
) -> None:
    status = to_rpc_status(error)
    assert (status.code, status.details) == (code, error.message)


def test_a_run_that_is_not_the_callers_reads_as_the_one_denial() -> None:
    assert to_rpc_status(errors.RunNotVisible()).details == DENIAL_MESSAGE
