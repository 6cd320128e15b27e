"""Session fixtures every cairn test suite shares: one real PostgreSQL (pgserver,
with pgvector), a development key pair, a token issuer, and the environment a
service process needs. Loaded with `-p cairn_libs.pytest_plugin` (pyproject).

Tests isolate themselves with a fresh org id (`new_org`) rather than a fresh
database, so the server starts once per run.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import start_embedded_postgres

TEST_STATE = Path(
    os.environ.get("CAIRN_TEST_STATE", Path(tempfile.gettempdir()) / "cairn-test-state")
)


@pytest.fixture(scope="session")
def state_dir() -> Path:
    TEST_STATE.mkdir(parents=True, exist_ok=True)
    return TEST_STATE


@pytest.fixture(scope="session")
def pg_url(state_dir: Path) -> str:
    return start_embedded_postgres(state_dir / "pg")


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


@pytest.fixture
def new_org() -> str:
    return f"org-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def log_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "logs"
    path.mkdir()
    yield path
