"""How retrieval's PostgreSQL adapters tell a database that is away (down,
restarting, overloaded) from any other failure, and the plan setting their
searches share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg

from cairn_libs.db import CONNECTION_ERRORS
from cairn_retrieval.errors import DatabaseUnavailable

# Every way a database that is down, restarting or overloaded shows itself: the
# shared list (which includes the InternalClientError of a restart mid-protocol),
# plus too many connections and a cancelled statement, both over once it recovers.
DATABASE_AWAY: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS,
    asyncpg.InsufficientResourcesError,
    asyncpg.OperatorInterventionError,
)


@contextmanager
def translated() -> Iterator[None]:
    try:
        yield
    except DATABASE_AWAY as exc:
        raise DatabaseUnavailable(
            f"the retrieval database did not answer ({type(exc).__name__}); retry shortly"
        ) from exc


# asyncpg prepares every statement; after five runs PostgreSQL may switch to a
# generic plan, costed without the parameters. For these statements the row
# counts hinge on the parameters (a rare or a common term, one audience or ten),
# and a generic plan measured 30-100 times slower at 100k chunks.
CUSTOM_PLANS = "SET LOCAL plan_cache_mode = force_custom_plan"
