"""A service process that cannot start because of its configuration says so in one
structured line, like every other event, and exits non-zero without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cairn_libs.stack import REPO_ROOT

A_SERVICE_WITH_A_MISSPELT_KEY = textwrap.dedent(
    """
    from cairn_libs.errors import ConfigurationError
    from cairn_libs.server import run_service

    def app_from_env():
        raise ConfigurationError("config.yaml: key 'provders' is not known; did you mean 'providers'?")

    run_service(app_from_env, default_port=1)
    """
)


def _start(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={"PATH": "/usr/bin:/bin", "CAIRN_LOG_LEVEL": "WARNING", **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _only_line(finished: subprocess.CompletedProcess[str]) -> dict[str, object]:
    output = (finished.stdout + finished.stderr).strip().splitlines()
    assert "Traceback" not in finished.stderr
    assert len(output) == 1, output
    event: dict[str, object] = json.loads(output[0])
    return event


def test_a_configuration_error_is_one_json_line_and_exit_code_2(
    dev_keys: tuple[Path, Path],
) -> None:
    finished = _start(
        A_SERVICE_WITH_A_MISSPELT_KEY, {"CAIRN_JWT_PUBLIC_KEY_FILE": str(dev_keys[1])}
    )

    event = _only_line(finished)
    assert finished.returncode == 2
    assert event["event"] == "service.config_invalid"
    assert event["level"] == "error"
    assert event["error"] == ("config.yaml: key 'provders' is not known; did you mean 'providers'?")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"CAIRN_JWT_PUBLIC_KEY_FILE": "/nowhere/key.pem"}, "/nowhere/key.pem"),
        ({"CAIRN_PORT": "fifty"}, "CAIRN_PORT='fifty'"),
        ({"CAIRN_GRPC_MAX_RECONNECT_BACKOFF_MS": "-3"}, "CAIRN_GRPC_MAX_RECONNECT_BACKOFF_MS"),
    ],
)
def test_the_bootstraps_own_settings_are_reported_the_same_way(
    dev_keys: tuple[Path, Path], env: dict[str, str], named: str
) -> None:
    finished = _start(
        A_SERVICE_WITH_A_MISSPELT_KEY, {"CAIRN_JWT_PUBLIC_KEY_FILE": str(dev_keys[1]), **env}
    )

    event = _only_line(finished)
    assert finished.returncode == 2
    assert event["event"] == "service.config_invalid"
    assert named in str(event["error"])


def test_any_other_start_up_failure_is_still_one_json_line(dev_keys: tuple[Path, Path]) -> None:
    code = A_SERVICE_WITH_A_MISSPELT_KEY.replace(
        'raise ConfigurationError("config.yaml', 'raise RuntimeError("config.yaml'
    )

    finished = _start(code, {"CAIRN_JWT_PUBLIC_KEY_FILE": str(dev_keys[1])})

    output = (finished.stdout + finished.stderr).strip().splitlines()
    assert finished.returncode == 1
    assert len(output) == 1, output
    event = json.loads(output[0])
    assert event["event"] == "service.start_failed"
    assert "RuntimeError: config.yaml" in event["exception"]


@pytest.mark.parametrize(
    ("module", "setting", "named"),
    [
        ("cairn_orchestrator", {"CAIRN_RUN_LEASE_SECONDS": "soon"}, "CAIRN_RUN_LEASE_SECONDS"),
        (
            "cairn_orchestrator",
            {"CAIRN_SERVICE_SIGNING_KEY_FILE": "/nonexistent/key.pem"},
            "CAIRN_SERVICE_SIGNING_KEY_FILE",
        ),
        (
            "cairn_memory",
            {"CAIRN_MEMORY_ENCRYPTION_KEY": "not base64!"},
            "CAIRN_MEMORY_ENCRYPTION_KEY",
        ),
        ("cairn_memory", {"CAIRN_EMBEDDER": "lokal"}, "CAIRN_EMBEDDER"),
        ("cairn_memory", {"DATABASE_URL": ""}, "DATABASE_URL"),
        ("cairn_memory", {"CAIRN_MEMORY_TTL_DAYS": "nan"}, "CAIRN_MEMORY_TTL_DAYS"),
        (
            "cairn_orchestrator",
            {"CAIRN_CONFIRMATION_TTL_SECONDS": "inf"},
            "CAIRN_CONFIRMATION_TTL_SECONDS",
        ),
        (
            "cairn_retrieval",
            {"QDRANT_URL": "http://q:6333", "CAIRN_QDRANT_TIMEOUT_SECONDS": "0"},
            "CAIRN_QDRANT_TIMEOUT_SECONDS",
        ),
    ],
)
def test_each_services_bad_setting_is_one_config_invalid_line(
    module: str, setting: dict[str, str], named: str, dev_keys: tuple[Path, Path], pg_url: str
) -> None:
    env = {
        "CAIRN_JWT_PUBLIC_KEY_FILE": str(dev_keys[1]),
        "CAIRN_SERVICE_SIGNING_KEY_FILE": str(dev_keys[0]),
        "DATABASE_URL": pg_url,
        "CAIRN_EMBEDDER": "none",
        **setting,
    }
    finished = _start(f"import runpy; runpy.run_module({module!r}, run_name='__main__')", env)

    event = _only_line(finished)
    assert (finished.returncode, event["event"]) == (2, "service.config_invalid")
    assert named in str(event["error"])
