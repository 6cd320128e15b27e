"""What the fake provider refuses, and why.

    FakeProviderError
    ├── RequestRejected   a /v1 request the real vendor would answer with 400
    └── ScriptRejected    a /_control/script body that names no behaviour we know

Both carry a message that names the bad value and says what would be accepted; the
server turns either into an OpenAI-shaped error object.
"""

from __future__ import annotations


class FakeProviderError(Exception):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestRejected(FakeProviderError):
    """The request body breaks the OpenAI wire contract."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_value"
    ) -> None:
        super().__init__(message, param=param)
        self.code = code


class ScriptRejected(FakeProviderError):
    """A scripted step is not one of the shapes the control surface accepts."""
