"""How does a test (of any service) start a fake provider and know it is ready?

It runs `python -m cairn_fakeprovider` as a real subprocess and waits for the one
listening line on stdout, so the caller gets the real port the moment the socket is
bound, without polling or sleeping.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class FakeProviderDidNotStart(RuntimeError):
    """The process exited or stayed silent instead of reporting that it listens."""


@dataclass
class FakeProviderProcess:
    process: subprocess.Popen[str]
    port: int
    name: str
    stderr_path: Path

    @property
    def base_url(self) -> str:
        """The root to put in front of /v1/... and /_control/..."""
        return f"http://127.0.0.1:{self.port}"

    def stop(self, *, timeout: float = 10.0) -> int:
        """Send SIGTERM (if still running) and return the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


def launch_fake_provider(
    *args: str, stderr_path: Path, startup_timeout: float = 20.0
) -> FakeProviderProcess:
    """Start a provider on a free port with extra CLI `args`; stderr goes to a file."""
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "cairn_fakeprovider", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert process.stdout is not None
    deadline = time.monotonic() + startup_timeout
    readable, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = process.stdout.readline() if readable else ""
    try:
        event = json.loads(line)
        if not isinstance(event, dict) or event.get("event") != "listening":
            raise ValueError(line)
    except ValueError as exc:
        process.kill()
        process.wait()
        process.stdout.close()
        raise FakeProviderDidNotStart(
            f"expected a listening line on stdout, got {line!r}; stderr:\n{stderr_path.read_text()}"
        ) from exc
    return FakeProviderProcess(
        process=process, port=int(event["port"]), name=str(event["name"]), stderr_path=stderr_path
    )
