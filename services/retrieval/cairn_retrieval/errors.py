"""What the retrieval service refuses or cannot reach, by cause.

    RetrievalError (CairnError)
    ├── BadDocument              a document fails validation         INVALID_ARGUMENT
    ├── BadSearch                a search names a bad value          INVALID_ARGUMENT
    ├── DocumentNotVisible       GetDocument of a document the       PERMISSION_DENIED
    │                            caller may not read, or of none     (the one denial)
    ├── DenseSearchUnavailable   DENSE_ONLY asked of a deployment    FAILED_PRECONDITION
    │                            that cannot run it (no embedder,
    │                            another model's collection)
    ├── DatabaseUnavailable      PostgreSQL did not answer           UNAVAILABLE
    ├── VectorStoreUnavailable   Qdrant did not answer               UNAVAILABLE
    ├── EmbedderFailed           the embedder raised on a text       UNAVAILABLE
    └── EmbeddingModelMismatch   the collection holds another        FAILED_PRECONDITION
                                 model's vectors

    ConfigInvalid (cairn_libs ConfigurationError)   a setting cannot be used: the
                                 process logs one line and exits at start-up

Access refusals are cairn_libs.errors.Denied (I6), GetDocument's too: a document
that does not exist and one the caller may not read are the same one denial, as a
run is in the orchestrator, so neither code nor message tells them apart.
A BadDocument inside a batch does not fail the call: it becomes that document's
FAILED result. VectorStoreUnavailable and EmbedderFailed during a search are
not errors either: the search degrades to keyword-only and says so (I11).
"""

from __future__ import annotations

from cairn_libs.errors import (
    CairnError,
    ConfigurationError,
    Conflict,
    Denied,
    DependencyUnavailable,
    InvalidInput,
)


class RetrievalError(CairnError):
    """Base of every error raised by the retrieval service."""


class BadDocument(RetrievalError, InvalidInput):
    pass


class BadSearch(RetrievalError, InvalidInput):
    pass


class DocumentNotVisible(RetrievalError, Denied):
    """I6: a document that does not exist and one the caller may not read read the same."""


class DenseSearchUnavailable(RetrievalError, Conflict):
    pass


class DatabaseUnavailable(RetrievalError, DependencyUnavailable):
    pass


class VectorStoreUnavailable(RetrievalError, DependencyUnavailable):
    pass


class EmbedderFailed(RetrievalError, DependencyUnavailable):
    pass


class EmbeddingModelMismatch(RetrievalError, Conflict):
    pass


class ConfigInvalid(ConfigurationError):
    """An environment setting retrieval cannot start with; never raised per call."""
