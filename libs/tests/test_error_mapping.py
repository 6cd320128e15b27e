from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from cairn_libs import errors
from cairn_libs.server import to_rpc_status

EXPECTED = {
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    errors.Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DependencyUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.NotConfigured: grpc.StatusCode.UNIMPLEMENTED,
}


def test_every_error_class_has_an_expected_mapping() -> None:
    # Services subclass these by cause; only the library's own classes are the mapping.
    own = {c for c in errors.CairnError.__subclasses__() if c.__module__ == errors.__name__}
    assert own == set(EXPECTED) | {errors.Denied}


@pytest.mark.parametrize(("cls", "code"), list(EXPECTED.items()))
def test_each_error_maps_to_its_status_with_its_message(
    cls: type[errors.CairnError], code: grpc.StatusCode
) -> None:
    status = to_rpc_status(cls("bad value 'x'; use 'y'"))
    assert status.code == code
    assert status.details == "bad value 'x'; use 'y'"


def test_every_denial_reads_the_same() -> None:
    status = to_rpc_status(errors.Denied())
    assert (status.code, status.details) == (errors.DENIAL_CODE, errors.DENIAL_MESSAGE)


def test_a_rate_limit_carries_retry_info_in_google_rpc_details() -> None:
    status = to_rpc_status(errors.ResourceExhausted("provider busy", retry_after_seconds=2.5))

    class _Call:
        def code(self) -> grpc.StatusCode:
            return status.code

        def details(self) -> str:
            return status.details

        def trailing_metadata(self) -> object:
            return status.trailing_metadata

    decoded = rpc_status.from_call(_Call())  # type: ignore[arg-type]
    assert decoded is not None
    infos = [d for d in decoded.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    retry = error_details_pb2.RetryInfo()
    infos[0].Unpack(retry)
    assert retry.retry_delay.ToMilliseconds() == 2500


def test_an_unexpected_exception_leaks_nothing() -> None:
    status = to_rpc_status(KeyError("secret internal detail"))
    assert (status.code, status.details) == (grpc.StatusCode.INTERNAL, "internal error")


class RunNotVisible(errors.Denied):
    """As a service subclasses the one denial, by cause."""


class DeniedWithAStory(errors.Denied):
    def __init__(self) -> None:
        errors.CairnError.__init__(self, "run r-1 belongs to another user")


def _error_info(status: grpc.Status) -> error_details_pb2.ErrorInfo:
    class _Call:
        def code(self) -> grpc.StatusCode:
            return status.code

        def details(self) -> str:
            return status.details

        def trailing_metadata(self) -> object:
            return status.trailing_metadata

    decoded = rpc_status.from_call(_Call())  # type: ignore[arg-type]
    assert decoded is not None
    (detail,) = decoded.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    return info


@pytest.mark.parametrize("cls", [errors.Denied, RunNotVisible, DeniedWithAStory])
def test_every_denial_subclass_reads_the_same_details_included(cls: type[errors.Denied]) -> None:
    status = to_rpc_status(cls())
    info = _error_info(status)

    assert (status.code, status.details) == (errors.DENIAL_CODE, errors.DENIAL_MESSAGE)
    assert (info.reason, info.domain) == ("DENIED", "cairn")
