"""make images, last step: run one service from its image against a real PostgreSQL
and wait until its health says SERVING, then stop it with SIGTERM and see it drain.

The service runs under `buildah run` (chroot isolation, the host's network) as its
image's non-root user, so the embedded PostgreSQL of cairn_libs.stack is reached
through its socket alone, bind-mounted into the container (the data directory it
sits in is private to PostgreSQL); the caller-token key is a fresh Ed25519 pair.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cairn_libs.stack import (
    free_port,
    health_status,
    start_embedded_postgres,
    stop_embedded_postgres,
    wait_until,
)

REPO = Path(__file__).resolve().parents[3]


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--image", required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("storage", nargs="*", help="buildah's global storage options")
    args = parser.parse_args()
    buildah = ["buildah", *args.storage]

    pg_dir = REPO / "build" / "images" / "pg"
    url = start_embedded_postgres(pg_dir)
    parts = urllib.parse.urlsplit(url)
    socket_dir = urllib.parse.parse_qs(parts.query)["host"][0]
    (socket,) = [p for p in Path(socket_dir).glob(".s.PGSQL.*") if p.is_socket()]
    container_url = urllib.parse.urlunsplit(parts._replace(query="host=/run/postgresql"))
    keys = Path(tempfile.mkdtemp(prefix="cairn-image-keys-"))
    public_key = Ed25519PrivateKey.generate().public_key()
    (keys / "public_key.pem").write_bytes(
        public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    os.chmod(keys, 0o755)
    os.chmod(keys / "public_key.pem", 0o644)
    port = free_port()
    container = subprocess.run(
        [*buildah, "from", "--pull=never", args.image], capture_output=True, text=True, check=True
    ).stdout.strip()
    log_path = REPO / "build" / "images" / "run.log"
    print(
        f"== {args.image}: python -m {args.module} on 127.0.0.1:{port}, PostgreSQL at {socket_dir}"
    )
    with log_path.open("w") as log:
        service = subprocess.Popen(
            [
                *buildah, "run", "--isolation", "chroot",
                "-v", f"{socket}:/run/postgresql/{socket.name}", "-v", f"{keys}:/keys:ro",
                "-e", "CAIRN_HOST=127.0.0.1", "-e", f"CAIRN_PORT={port}",
                "-e", f"DATABASE_URL={container_url}", "-e", "CAIRN_JWT_PUBLIC_KEY_FILE=/keys/public_key.pem",
                "-e", "CAIRN_SHUTDOWN_GRACE_SECONDS=2",
                container, "--", "python", "-m", args.module,
            ],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        status = wait_until(
            lambda: (s := health_status(f"127.0.0.1:{port}")) == "SERVING" and s,
            timeout=180,
            interval=0.5,
        )
        print(f"   grpc.health.v1 says {status}")
    finally:
        # SIGTERM to the service itself (buildah's child), as the kubelet would send
        # it; buildah then ends with it.
        for child in _descendants(service.pid):
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"/python") and argv[1:3] == [b"-m", args.module.encode()]:
                os.kill(child, signal.SIGTERM)
        try:
            code = service.wait(timeout=60)
        finally:
            subprocess.run([*buildah, "rm", container], capture_output=True, check=False)
            stop_embedded_postgres(pg_dir)
    events = []
    for line in log_path.read_text().splitlines():
        try:
            events.append(json.loads(line)["event"])
        except (ValueError, KeyError, TypeError):
            continue
    wanted = ["service.listening", "service.stopping", "service.stopped"]
    print(f"   exit {code}; events seen: {[e for e in events if e in wanted]}")
    return 0 if all(e in events for e in wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
