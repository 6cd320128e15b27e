"""Session fixtures every cairn test suite shares: one real PostgreSQL (pgserver,
with pgvector), a development key pair, a token issuer, and the environment a
service process needs. Loaded with `-p cairn_libs.pytest_plugin` (pyproject).

Tests isolate themselves with a fresh org id (`new_org`) rather than a fresh
database, so the server starts once per run.

Each run keeps its state (database, keys) in a folder of its own under the system
temp dir and stops its PostgreSQL when the session ends: a fixed shared folder let
two checkouts testing at once share one database and one key pair, and let a later
run silently reuse a server started from another checkout's binaries.
`CAIRN_TEST_STATE` names a folder to use instead (kept afterwards, server stopped).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import asyncpg
import pytest

from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import start_embedded_postgres, stop_embedded_postgres


@pytest.fixture(scope="session")
def state_dir() -> Iterator[Path]:
    chosen = os.environ.get("CAIRN_TEST_STATE")
    if chosen:
        path = Path(chosen)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    # Short on purpose: PostgreSQL's socket lives under it, and a socket path is
    # limited to about 100 bytes.
    path = Path(tempfile.mkdtemp(prefix="cairn-test-"))
    # As root, pgserver runs PostgreSQL as the user `pgserver`, which must reach it.
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_url(state_dir: Path) -> Iterator[str]:
    url = start_embedded_postgres(state_dir / "pg")
    try:
        yield url
    finally:
        stop_embedded_postgres(state_dir / "pg")


@pytest.fixture(scope="session")
def dev_keys(state_dir: Path) -> tuple[Path, Path]:
    return generate_dev_keypair(state_dir / "keys")


@pytest.fixture(scope="session")
def issuer(dev_keys: tuple[Path, Path]) -> TokenIssuer:
    return TokenIssuer.from_file(dev_keys[0])


@pytest.fixture(scope="session")
def service_env(pg_url: str, dev_keys: tuple[Path, Path]) -> dict[str, str]:
    """What every service process needs; tests add their own settings on top."""
    return {
        "DATABASE_URL": pg_url,
        "CAIRN_JWT_PUBLIC_KEY_FILE": str(dev_keys[1]),
        "CAIRN_SERVICE_SIGNING_KEY_FILE": str(dev_keys[0]),
        "CAIRN_HEALTH_INTERVAL_SECONDS": "0.2",
        "CAIRN_LOG_LEVEL": "INFO",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


def stored_text_locations(url: str, needle: str, *, schemas: Sequence[str]) -> list[str]:
    """`find_stored_text` for a test that is not a coroutine."""
    return asyncio.run(find_stored_text(url, needle, schemas=schemas))


async def find_stored_text(url: str, needle: str, *, schemas: Sequence[str]) -> list[str]:
    """Every `schema.table.column` of `schemas` whose stored value holds `needle`: as
    text, inside JSON (escaped as PostgreSQL prints it), as UTF-8 bytes, or as the
    search terms of a tsvector. The erasure tests (I9) search every table with it, so
    a copy nobody thought of is still found."""
    escaped = json.dumps(needle)[1:-1]
    ascii_escaped = json.dumps(needle, ensure_ascii=True)[1:-1]

    conn = await asyncpg.connect(url)
    try:
        columns = await conn.fetch(
            "SELECT table_schema, table_name, column_name, data_type, udt_name "
            "FROM information_schema.columns c JOIN information_schema.tables t "
            "USING (table_schema, table_name) "
            "WHERE table_schema = ANY($1::text[]) AND t.table_type = 'BASE TABLE' "
            "ORDER BY 1, 2, 3",
            list(schemas),
        )
        found: list[str] = []
        for column in columns:
            target = f'"{column["table_schema"]}"."{column["table_name"]}"'
            name = f'"{column["column_name"]}"'
            udt = column["udt_name"]
            if udt == "tsvector":
                where = f"{name} @@ plainto_tsquery('english', $1)"
                args: list[object] = [needle]
            elif udt == "bytea":
                where = f"position(convert_to($1, 'UTF8') in {name}) > 0"
                args = [needle]
            elif udt in ("text", "varchar", "bpchar", "json", "jsonb", "_text", "name"):
                where = (
                    f"(strpos({name}::text, $1) > 0 OR strpos({name}::text, $2) > 0 "
                    f"OR strpos({name}::text, $3) > 0)"
                )
                args = [needle, escaped, ascii_escaped]
            else:
                continue
            hits = await conn.fetchval(f"SELECT count(*) FROM {target} WHERE {where}", *args)
            if hits:
                found.append(
                    f"{column['table_schema']}.{column['table_name']}.{column['column_name']}"
                )
        return found
    finally:
        await conn.close()


@pytest.fixture
def new_org() -> str:
    return f"org-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def log_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "logs"
    path.mkdir()
    yield path
