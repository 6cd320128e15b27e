"""Fixtures for the memory service's tests: the service as real processes (one with
the local embedder, one with CAIRN_EMBEDDER=none) over one real PostgreSQL, typed
clients that carry a caller token and optionally an actor token, and the store in
process for what needs a fake clock."""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.db import Database
from cairn_libs.embedding import Embedder, LocalOnnxEmbedder
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import ServiceProcess, free_port, start_service, wait_for_health
from cairn_memory.postgres import migrations

TIMEOUT = 20.0


@dataclass
class MemoryClient:
    """One caller (and optionally one acting run) talking to one memory process."""

    stub: memory_pb2_grpc.MemoryServiceStub
    metadata: tuple[tuple[str, str], ...]
    org_id: str
    user_id: str

    def remember(
        self, text: str, subject: memory_pb2.Subject | None = None, **fields: Any
    ) -> memory_pb2.RememberResponse:
        request = memory_pb2.RememberRequest(
            text=text,
            subject=subject or memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE),
            **fields,
        )
        return self.stub.Remember(request, metadata=self.metadata, timeout=TIMEOUT)

    def recall(self, query: str = "", **fields: Any) -> memory_pb2.RecallResponse:
        request = memory_pb2.RecallRequest(query=query, **fields)
        return self.stub.Recall(request, metadata=self.metadata, timeout=TIMEOUT)

    def held(self, subject: memory_pb2.Subject, **fields: Any) -> memory_pb2.HeldResponse:
        return self.stub.Held(
            memory_pb2.HeldRequest(subject=subject, **fields),
            metadata=self.metadata,
            timeout=TIMEOUT,
        )

    def forget(self, subject: memory_pb2.Subject) -> memory_pb2.ForgetResponse:
        return self.stub.Forget(
            memory_pb2.ForgetRequest(subject=subject), metadata=self.metadata, timeout=TIMEOUT
        )

    def update_profile(
        self, subject: memory_pb2.Subject, fact_key: str, value: str, **fields: Any
    ) -> memory_pb2.UpdateProfileResponse:
        request = memory_pb2.UpdateProfileRequest(
            subject=subject, fact_key=fact_key, value=value, **fields
        )
        return self.stub.UpdateProfile(request, metadata=self.metadata, timeout=TIMEOUT)

    def archive(self, label: str, content: str, conversation_id: str, role: str = "user") -> str:
        request = memory_pb2.ArchiveRequest(
            label=label, content=content, conversation_id=conversation_id, role=role
        )
        return self.stub.Archive(request, metadata=self.metadata, timeout=TIMEOUT).block_id

    def recall_block(self, block_id: str) -> memory_pb2.Block:
        request = memory_pb2.RecallBlockRequest(block_id=block_id)
        return self.stub.RecallBlock(request, metadata=self.metadata, timeout=TIMEOUT).block

    def search_blocks(self, query: str, **fields: Any) -> list[memory_pb2.Block]:
        request = memory_pb2.SearchBlocksRequest(query=query, **fields)
        return list(self.stub.SearchBlocks(request, metadata=self.metadata, timeout=TIMEOUT).blocks)


ClientFactory = Callable[..., MemoryClient]


def client_factory(channel: grpc.Channel, issuer: TokenIssuer, default_org: str) -> ClientFactory:
    stub = memory_pb2_grpc.MemoryServiceStub(channel)

    def make(
        user_id: str = "alice",
        *,
        org_id: str | None = None,
        run_id: str = "",
        agent: str = "",
        roles: tuple[str, ...] = ("privacy_officer",),
    ) -> MemoryClient:
        # By default a test caller may also list and erase subjects (Held/Forget);
        # tests of that rule pass roles=().
        org = org_id or default_org
        token = issuer.caller_token(org_id=org, user_id=user_id, roles=list(roles))
        actor = (
            issuer.actor_token(service="orchestrator", run_id=run_id, agent=agent) if run_id else ""
        )
        return MemoryClient(
            stub=stub, metadata=call_metadata(token, actor_token=actor), org_id=org, user_id=user_id
        )

    return make


def _start(
    service_env: dict[str, str], log_dir: Path, *, suffix: str, **env: str
) -> ServiceProcess:
    proc = start_service(
        "memory",
        port=free_port(),
        env={**service_env, **env},
        log_dir=log_dir,
        suffix=suffix,
    )
    try:
        wait_for_health(proc)
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="session")
def memory_process(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    proc = _start(
        service_env, tmp_path_factory.mktemp("memory-logs"), suffix="", CAIRN_EMBEDDER="local"
    )
    yield proc
    proc.stop()


VARIANT_TTL_DAYS = 7
VARIANT_BLOCK_TTL_DAYS = 3
VARIANT_KEY = base64.b64encode(os.urandom(32)).decode()


@pytest.fixture(scope="session")
def variant_process(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The other deployment settings in one process: no embedder, a 7-day time to
    live for memories and 3 days for blocks, and encryption at rest with its own key."""
    proc = _start(
        service_env,
        tmp_path_factory.mktemp("memory-variant-logs"),
        suffix="-variant",
        CAIRN_EMBEDDER="none",
        CAIRN_MEMORY_TTL_DAYS=str(VARIANT_TTL_DAYS),
        CAIRN_MEMORY_BLOCK_TTL_DAYS=str(VARIANT_BLOCK_TTL_DAYS),
        CAIRN_MEMORY_ENCRYPTION_KEY=VARIANT_KEY,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def memory_channel(memory_process: ServiceProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(memory_process.address) as channel:
        yield channel


@pytest.fixture(scope="session")
def variant_channel(variant_process: ServiceProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(variant_process.address) as channel:
        yield channel


@pytest.fixture
def client(memory_channel: grpc.Channel, issuer: TokenIssuer, new_org: str) -> ClientFactory:
    """client(user, org_id=..., run_id=..., agent=...) -> a caller of the embedder-backed process."""
    return client_factory(memory_channel, issuer, new_org)


@pytest.fixture
def variant_client(
    variant_channel: grpc.Channel, issuer: TokenIssuer, new_org: str
) -> ClientFactory:
    """The same (same default org), against the variant process."""
    return client_factory(variant_channel, issuer, new_org)


@pytest.fixture(scope="session")
def isolated_schema(pg_url: str) -> Iterator[str]:
    """A schema of its own for in-process tests with a fake clock: their purges
    delete by time across the whole schema, so they must not share one with the
    service processes (or with a concurrent test run)."""
    schema = f"memory_test_{uuid.uuid4().hex[:10]}"
    yield schema

    async def drop() -> None:
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()

    asyncio.run(drop())


@pytest.fixture(scope="session")
async def isolated_database(pg_url: str, isolated_schema: str) -> AsyncIterator[Database]:
    database = Database(url=pg_url, schema=isolated_schema, migrations=migrations())
    assert await database.ready()
    yield database
    await database.close()


@pytest.fixture(scope="session")
def local_embedder() -> Embedder:
    return LocalOnnxEmbedder()
