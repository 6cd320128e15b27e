"""Fake providers as real subprocesses, started once and reset between tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from cairn_fakeprovider.launch import FakeProviderProcess, launch_fake_provider


@pytest.fixture(scope="session")
def fake_provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeProviderProcess]:
    log_dir = tmp_path_factory.mktemp("fakeprovider")
    provider = launch_fake_provider("--name", "shared", stderr_path=log_dir / "stderr.log")
    yield provider
    provider.stop()


@pytest.fixture
def client(fake_provider: FakeProviderProcess) -> Iterator[httpx.Client]:
    """A client of the shared provider, with its script queue and request log empty."""
    with httpx.Client(base_url=fake_provider.base_url, timeout=10.0) as http:
        http.post("/_control/reset").raise_for_status()
        yield http


@pytest.fixture
def start_provider(tmp_path: Path) -> Iterator[Callable[..., FakeProviderProcess]]:
    """Start an extra provider with its own flags; it is stopped after the test."""
    started: list[FakeProviderProcess] = []

    def start(*args: str) -> FakeProviderProcess:
        provider = launch_fake_provider(*args, stderr_path=tmp_path / f"stderr-{len(started)}.log")
        started.append(provider)
        return provider

    yield start
    for provider in started:
        provider.stop()
