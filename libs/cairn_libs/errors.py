"""What can go wrong in any cairn service, and the one place it becomes a gRPC status.

    CairnError
    ├── Unauthenticated        missing, forged or expired token          UNAUTHENTICATED
    ├── Denied                 the one denial (I6): never says why       PERMISSION_DENIED
    ├── InvalidInput           the request names a bad value             INVALID_ARGUMENT
    ├── Conflict               the request contradicts current state     FAILED_PRECONDITION
    ├── ResourceExhausted      a ceiling or budget would be passed       RESOURCE_EXHAUSTED
    ├── DependencyUnavailable  a backend (database, Qdrant, provider)    UNAVAILABLE
    └── NotConfigured          the deployment lacks the part asked for   UNIMPLEMENTED

Services subclass these by cause; the error-mapping interceptor turns any of them
into a status with the class's code. Anything else becomes INTERNAL with a generic
message, so an unexpected exception never leaks internals to a caller.

    ConfigurationError         the deployment's settings cannot be used  (exit 2)

ConfigurationError stands outside the tree because it never reaches a caller: it
is raised while a service is built, and `run_service` logs it as one structured
line and exits. A service's own configuration error may derive from both (the
gateway's ConfigInvalid is also a NotConfigured).
"""

from __future__ import annotations

import grpc

# I6: every refusal reads the same, so a caller cannot tell "does not exist" from
# "not yours".
DENIAL_CODE = grpc.StatusCode.PERMISSION_DENIED
DENIAL_MESSAGE = "not found or not permitted"


class CairnError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_seconds = retry_after_seconds


class Unauthenticated(CairnError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Denied(CairnError):
    code = DENIAL_CODE

    def __init__(self) -> None:
        super().__init__(DENIAL_MESSAGE)


class InvalidInput(CairnError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Conflict(CairnError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(CairnError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DependencyUnavailable(CairnError):
    code = grpc.StatusCode.UNAVAILABLE


class NotConfigured(CairnError):
    code = grpc.StatusCode.UNIMPLEMENTED


class ConfigurationError(Exception):
    """A setting, file or variable the service cannot start with. The message names
    the setting and the bad value (never a secret) and says what would be accepted."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller sees for an exception."""
    if isinstance(exc, CairnError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, "internal error"
