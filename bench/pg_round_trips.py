"""Counting the PostgreSQL round trips a process makes, on the wire: a small proxy
between the process and PostgreSQL that reads the client's side of the protocol.

A round trip is a message the client then waits on: a simple Query ('Q', which
also carries asyncpg's pool reset, BEGIN and COMMIT) or a Sync ('S', which ends
each extended-protocol exchange: a prepare, or one or more Bind/Execute of a
statement, as executemany sends them). Each is labelled with its statement's text,
so a count says which statements a run makes. Counted where it happens rather
than inside the process, so the process under test runs its own unchanged code.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

_STARTUP_CODES = {196608, 80877103, 80877104}  # protocol 3.0, SSLRequest, GSSENCRequest


@dataclass
class RoundTrips:
    """Round trips seen since the last `reset`, by label (the statement's first words)."""

    by_statement: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_statement.values())

    def reset(self) -> None:
        self.by_statement.clear()


def _label(query: str) -> str:
    words = " ".join(query.split())
    return words[:90]


class _ClientSide:
    """Parses what a client sends, one message at a time, counting round trips."""

    def __init__(self, counts: RoundTrips) -> None:
        self._counts = counts
        self._buffer = b""
        self._started = False
        self._statements: dict[str, str] = {}
        self._pending: list[str] = []

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while True:
            if not self._started:
                if len(self._buffer) < 8:
                    return
                (length, code) = struct.unpack("!ii", self._buffer[:8])
                if len(self._buffer) < length:
                    return
                self._buffer = self._buffer[length:]
                self._started = code == 196608 or code not in _STARTUP_CODES
                continue
            if len(self._buffer) < 5:
                return
            kind = self._buffer[:1]
            (length,) = struct.unpack("!i", self._buffer[1:5])
            if len(self._buffer) < 1 + length:
                return
            body = self._buffer[5 : 1 + length]
            self._buffer = self._buffer[1 + length :]
            self._message(kind, body)

    def _message(self, kind: bytes, body: bytes) -> None:
        if kind == b"Q":
            self._counts.by_statement[_label(body.rstrip(b"\0").decode(errors="replace"))] += 1
        elif kind == b"P":
            name, _, rest = body.partition(b"\0")
            query = rest.partition(b"\0")[0].decode(errors="replace")
            self._statements[name.decode()] = query
            self._pending.append("prepare: " + query)
        elif kind == b"B":
            statement = body.partition(b"\0")[2].partition(b"\0")[0].decode()
            self._pending.append(self._statements.get(statement, "?"))
        elif kind == b"S":
            binds = [p for p in self._pending if not p.startswith("prepare: ")]
            label = binds[0] if binds else (self._pending[0] if self._pending else "sync")
            self._counts.by_statement[_label(label)] += 1
            self._pending = []


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, side: _ClientSide | None
) -> None:
    try:
        while data := await reader.read(65536):
            if side is not None:
                side.feed(data)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, RuntimeError):
            writer.close()


def _unix_socket(pg_url: str) -> str:
    parts = urlsplit(pg_url)
    host = parse_qs(parts.query).get("host", [""])[0]
    if not host:
        raise ValueError(f"{pg_url!r} names no unix socket directory (?host=); pgserver's do")
    return f"{host}/.s.PGSQL.{parts.port or 5432}"


@asynccontextmanager
async def counting_proxy(pg_url: str) -> AsyncIterator[tuple[str, RoundTrips]]:
    """A TCP address in front of pgserver's PostgreSQL (`pg_url`), as a URL for the
    process under test, and the round trips that pass through it."""
    counts = RoundTrips()
    socket_path = _unix_socket(pg_url)
    tasks: set[asyncio.Task[None]] = set()

    async def accept(
        client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        server_reader, server_writer = await asyncio.open_unix_connection(socket_path)
        for task in (
            asyncio.create_task(_pipe(client_reader, server_writer, _ClientSide(counts))),
            asyncio.create_task(_pipe(server_reader, client_writer, None)),
        ):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    user = urlsplit(pg_url).username or "postgres"
    database = urlsplit(pg_url).path.lstrip("/") or "postgres"
    try:
        yield f"postgresql://{user}:@127.0.0.1:{port}/{database}?sslmode=disable", counts
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
