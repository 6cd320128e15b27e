"""What the memory service refuses, and why.

    MemoryServiceError
    ├── RefusedInput          (InvalidInput)           a request field names a bad value
    │   ├── SecretInText                               text looks like a key, token, password or code
    │   └── NotOneSentence                             a memory is one sentence of at most 300 chars
    ├── StaleReference        (Conflict)               the request contradicts what is held now
    │   ├── SupersedesNotActive                        a superseded id is not an active memory here
    │   └── ProfileValueChanged                        previous_value is not the current value
    ├── StorageUnavailable    (DependencyUnavailable)  PostgreSQL did not answer
    └── CopiesUnreachable     (DependencyUnavailable)  erased here; a holder of copies did not answer

Access refusals are never one of these: they are `cairn_libs.errors.Denied()`, the
one denial every service gives (I6), so a caller cannot tell "missing" from "not yours".
"""

from __future__ import annotations

from cairn_libs.errors import CairnError, Conflict, DependencyUnavailable, InvalidInput


class MemoryServiceError(CairnError):
    """Base of every refusal the memory service raises itself."""


class RefusedInput(MemoryServiceError, InvalidInput):
    """A request field names a value the service does not accept."""


class SecretInText(RefusedInput):
    """Text looks like a secret; the message names the kind, never the secret."""


class NotOneSentence(RefusedInput):
    """A memory is one sentence; longer text is refused with the reason."""


class StaleReference(MemoryServiceError, Conflict):
    """The request refers to a state that is not the current one."""


class SupersedesNotActive(StaleReference):
    """A superseded id is not an active memory of the same org and subject."""


class ProfileValueChanged(StaleReference):
    """A compare-and-set on a profile fact found another current value."""


class StorageUnavailable(MemoryServiceError, DependencyUnavailable):
    """PostgreSQL refused or dropped the connection."""


class CopiesUnreachable(MemoryServiceError, DependencyUnavailable):
    """The erasure here is done and kept, but a service holding copies did not erase
    them; Forget again finishes it."""
