"""What the gateway refuses or fails with, and the gRPC status each one becomes.

    GatewayError
    ├── ConfigInvalid              the provider file is wrong (at start-up)       -> one JSON line, exit 2
    ├── ChatRequestInvalid         a bad message, tool schema, model or tier      INVALID_ARGUMENT
    ├── ProviderRejectedRequest    the provider answered 400/404/422-style        INVALID_ARGUMENT
    ├── ProviderCredentialRejected the provider refused the deployment's key      FAILED_PRECONDITION
    ├── RunBudgetExceeded          the call cannot fit the run's remaining budget RESOURCE_EXHAUSTED
    ├── ProviderRateLimited        429 or a ceiling, failover not allowed/left    RESOURCE_EXHAUSTED (+RetryInfo)
    ├── CallExceedsCeiling         one call larger than a whole minute's ceiling  RESOURCE_EXHAUSTED
    ├── ProviderUnavailable        5xx, timeout, connection, malformed; or all    UNAVAILABLE
    │                              providers failed
    │   └── StreamCut              a stream broke after content reached the caller UNAVAILABLE
    ├── LedgerUnavailable          budget/ceiling state in PostgreSQL unreachable UNAVAILABLE
    │   └── CooldownsUnavailable   shared cooldowns unreachable: never a caller's (each
    │                              replica keeps its own meanwhile; logged)
    ├── NoUsableProvider           the deployment has no usable provider for the  FAILED_PRECONDITION
    │                              tier, model or embedding model asked (a key
    │                              variable unset, a tier no provider serves)
    └── NoProviderConfigured       the embedder is turned off (CAIRN_EMBEDDER)    UNIMPLEMENTED

Each class also subclasses the cairn_libs error whose code it carries, so the
shared interceptor maps it; the gateway never builds a gRPC status itself.
A message never contains a provider key or prompt text.
"""

from __future__ import annotations

from cairn_libs.errors import (
    CairnError,
    ConfigurationError,
    Conflict,
    DependencyUnavailable,
    InvalidInput,
    NotConfigured,
    ResourceExhausted,
)


class GatewayError(CairnError):
    """Base of every error the gateway raises on purpose."""


class ConfigInvalid(GatewayError, NotConfigured, ConfigurationError):
    """The provider configuration cannot be used; raised at start-up, never per call.
    As a ConfigurationError, run_service logs it as one `service.config_invalid` line
    and exits, instead of a traceback through the start-up code."""


class ChatRequestInvalid(GatewayError, InvalidInput):
    pass


class ProviderRejectedRequest(GatewayError, InvalidInput):
    pass


class ProviderCredentialRejected(GatewayError, Conflict):
    pass


class RunBudgetExceeded(GatewayError, ResourceExhausted):
    pass


class ProviderRateLimited(GatewayError, ResourceExhausted):
    pass


class CallExceedsCeiling(GatewayError, ResourceExhausted):
    pass


class ProviderUnavailable(GatewayError, DependencyUnavailable):
    pass


class StreamCut(ProviderUnavailable):
    pass


class LedgerUnavailable(GatewayError, DependencyUnavailable):
    pass


class CooldownsUnavailable(LedgerUnavailable):
    """The shared cooldowns could not be read or written. A cooldown only spares
    calls, so this never fails a call: each replica keeps its own meanwhile."""


class NoUsableProvider(GatewayError, Conflict):
    """A deployment mistake, not the caller's: the request is valid, but no provider
    this gateway can use serves it. FAILED_PRECONDITION rather than UNIMPLEMENTED,
    which reads as "this RPC does not exist" and is never worth fixing a config for."""


class NoProviderConfigured(GatewayError, NotConfigured):
    pass
