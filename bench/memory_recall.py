"""Memory recall at scale, through the real gRPC service: semantic and newest-first
Recall with 100k memories in the measured org among 1M in total, the quality of the
approximate (HNSW) answer against an exact scan, and Remember throughput.

The 1M-row dataset is far too big to embed on this machine for every run (the
local ONNX model makes ~500 vectors/s on 2 cores), so it is built once into its
own database under state/bench and reused, keyed by DATASET_VERSION and size:

- the measured org's memories are 100k generated one-sentence memories with
  their real embeddings (cached under state/bench once made);
- every other org's memories are sentences drawn from the same pool, with
  synthetic vectors: 0.6 x the sentence's real embedding + 0.4 x a random other
  sentence's + Gaussian noise, re-normalised, bulk-loaded with COPY straight into
  the memory schema. They sit among the measured org's vectors in the HNSW graph
  (the hard case for an org-filtered approximate search) without being ~10
  near-identical copies of each sentence (version 1 did that, and its duplicate
  clusters split the graph into islands: recall@5 0.89).

Each org holds superseded, erased and out-of-validity-window memories too (5%, 2%,
2%); every answer is checked against the database afterwards, and a single row
of another org, or one that is not recallable, fails the benchmark. Expired rows
are not part of the stored dataset: the service purges them on start-up, so a
reused dataset would not hold them anyway; the dataset's memories carry a five-year
expiry so that reusing it for months does not change it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import asyncpg
import numpy as np
from rich.console import Console

from bench.figures import Figure, percentile
from bench.harness import STATE
from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.embedding import LocalOnnxEmbedder
from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import (
    ServiceProcess,
    free_port,
    start_embedded_postgres,
    start_service,
    wait_for_health,
)
from cairn_memory.domain import Subject, SubjectKind, normalised_text
from cairn_memory.pg_memories import (
    SEMANTIC_SETTINGS,
    newest_recall_args,
    newest_recall_sql,
    semantic_recall_args,
    semantic_recall_sql,
)
from cairn_memory.postgres import SCHEMA, memory_database

# Bump when the generator, the layout or the stored columns change: a new version
# builds a new database; old ones can be dropped by hand (`bench_memory_v*`).
DATASET_VERSION: Final = 2
SENTENCE_SEED: Final = 1  # fixed across versions, so cached embeddings stay valid
MEASURED_ORG: Final = "bench-measured"
K: Final = 5
NOISE_SIGMA: Final = 0.02  # 384 dims: |noise| ~ 0.39
BLEND: Final = 0.6  # weight of a row's own sentence; the rest is another sentence's
DATASET_TTL: Final = timedelta(days=5 * 365)
COPY_CHUNK: Final = 20_000

console = Console()


@dataclass(frozen=True)
class Scale:
    measured: int
    total: int

    @property
    def database(self) -> str:
        return f"bench_memory_v{DATASET_VERSION}_{self.total}"

    def orgs(self) -> list[tuple[str, int]]:
        """(org_id, memories): the measured org, 6 as large, 20 at a tenth, 100 at a
        hundredth, so the measured org holds a tenth of everything."""
        m = self.measured
        layout = [(MEASURED_ORG, m)]
        layout += [(f"bench-large-{i}", m) for i in range(6)]
        layout += [(f"bench-medium-{i}", m // 10) for i in range(20)]
        layout += [(f"bench-small-{i}", m // 100) for i in range(100)]
        assert sum(n for _, n in layout) == self.total, layout
        return layout


FULL: Final = Scale(measured=100_000, total=1_000_000)
QUICK: Final = Scale(measured=10_000, total=100_000)


# --- what people would have an agent remember -------------------------------------

_NAMES = (
    "Priya", "Tomasz", "Amara", "Lucas", "Mei", "Jonas", "Fatima", "Diego", "Ingrid", "Kwame",
    "Sofia", "Ravi", "Elena", "Hiroshi", "Chloe", "Omar", "Anika", "Mateo", "Zara", "Felix",
    "Nadia", "Samuel", "Leila", "Viktor", "Aisha", "Henrik", "Yuki", "Marco", "Olivia", "Tariq",
    "Greta", "Kofi", "Lena", "Pablo", "Sana", "Erik", "Maya", "Ibrahim", "Clara", "Rafael",
)  # fmt: skip
_TEAMS = (
    "platform", "payments", "search", "mobile", "data", "security", "growth", "support",
    "infrastructure", "design", "billing", "onboarding", "analytics", "compliance", "sales",
)  # fmt: skip
_PROJECTS = (
    "Atlas", "Beacon", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Harbor", "Iris",
    "Juniper", "Kestrel", "Lumen", "Meridian", "Nimbus", "Orion", "Pioneer", "Quartz", "Relay",
    "Summit", "Tundra", "Umbra", "Vertex", "Willow", "Zephyr",
)  # fmt: skip
_MEETINGS = (
    "weekly planning meeting", "design review", "quarterly business review", "one-on-one",
    "incident retrospective", "sprint demo", "budget review", "hiring debrief", "architecture sync",
    "customer call", "board update", "roadmap session",
)  # fmt: skip
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
_TIMES = ("early morning", "late morning", "just after lunch", "mid afternoon", "late afternoon")
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
_COMPANIES = (
    "Northwind", "Contoso", "Globex", "Initech", "Umbrella Health", "Stark Logistics", "Wayne Foods",
    "Acme Retail", "Hooli", "Vandelay Imports", "Soylent Farms", "Tyrell Energy", "Cyberdyne Labs",
    "Oscorp Media", "Gringotts Bank", "Monarch Travel",
)  # fmt: skip
_REQUESTS = (
    "a longer trial period", "single sign-on", "an on-premise deployment", "a discount on seats",
    "a dedicated support contact", "data residency in the EU", "an export of all their reports",
    "monthly invoicing", "a security questionnaire", "priority access to the beta",
)  # fmt: skip
_REASONS = (
    "a vendor delay", "an open security review", "missing test coverage", "a hiring freeze",
    "a pending legal review", "an outage last week", "a change in scope", "budget approval",
)  # fmt: skip
_DRINKS = ("oat milk flat whites", "green tea", "black coffee", "sparkling water", "chai lattes")
_CITIES = (
    "Lisbon", "Berlin", "Nairobi", "Toronto", "Singapore", "Austin", "Warsaw", "Bogota", "Osaka",
    "Dublin", "Cape Town", "Melbourne",
)  # fmt: skip
_TOOLS = ("Python", "Go", "Kubernetes", "PostgreSQL", "Terraform", "React", "Kafka", "Rust")

_TEMPLATES: Final[tuple[tuple[str, ...], ...]] = (
    ("{n} prefers to hold the {mt} on {d} {t}.",),
    ("{n} asked that the {mt} for {p} move to {d}.",),
    ("The {tm} team plans to ship {p} by the end of {mo}.",),
    ("{n} said the {p} launch slipped to {mo} because of {r}.",),
    ("{c} asked for {rq} before renewing their contract in {mo}.",),
    ("{n} will be travelling to {ci} for the {mt} in {mo}.",),
    ("{n} drinks {dr} and dislikes meetings before ten on {d}.",),
    ("{n} is the main contact at {c} for anything about {p}.",),
    ("{n} joined the {tm} team in {mo} and mostly works with {tl}.",),
    ("The {mt} with {c} went well and they want a follow-up on {d}.",),
    ("{n} is blocked on {p} until {r} is resolved.",),
    ("{n} wants to be reminded about the {mt} every {d} {t}.",),
    ("{c} reported slow dashboards in {ci} since the {p} rollout.",),
    ("{n} volunteered to run the {mt} for the {tm} team in {mo}.",),
    ("{n} moved from {ci} and now works remotely for the {tm} team.",),
    ("The {tm} team agreed to migrate {p} to {tl} during {mo}.",),
)


def _sentence(rng: random.Random) -> str:
    (template,) = rng.choice(_TEMPLATES)
    return template.format(
        n=rng.choice(_NAMES),
        tm=rng.choice(_TEAMS),
        p=rng.choice(_PROJECTS),
        mt=rng.choice(_MEETINGS),
        d=rng.choice(_DAYS),
        t=rng.choice(_TIMES),
        mo=rng.choice(_MONTHS),
        c=rng.choice(_COMPANIES),
        rq=rng.choice(_REQUESTS),
        r=rng.choice(_REASONS),
        dr=rng.choice(_DRINKS),
        ci=rng.choice(_CITIES),
        tl=rng.choice(_TOOLS),
    )


def unique_sentences(n: int, *, seed: int) -> list[str]:
    rng = random.Random(seed)
    seen: set[str] = set()
    found: list[str] = []
    while len(found) < n:
        text = _sentence(rng)
        if text not in seen:
            seen.add(text)
            found.append(text)
    return found


_QUESTIONS: Final = (
    "When does {n} like to hold the {mt}?",
    "What did {c} ask for before renewal?",
    "Why did the {p} launch slip?",
    "Who is our contact at {c}?",
    "What does {n} drink?",
    "Which team is shipping {p}?",
    "Is anyone travelling to {ci} soon?",
    "What is blocking {p}?",
    "Which customers complained about slow dashboards?",
    "Who works with {tl} on the {tm} team?",
)


def questions(n: int, *, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        rng.choice(_QUESTIONS).format(
            n=rng.choice(_NAMES),
            mt=rng.choice(_MEETINGS),
            c=rng.choice(_COMPANIES),
            p=rng.choice(_PROJECTS),
            ci=rng.choice(_CITIES),
            tl=rng.choice(_TOOLS),
            tm=rng.choice(_TEAMS),
        )
        for _ in range(n)
    ]


# --- the dataset ------------------------------------------------------------------

_COLUMNS: Final = (
    "memory_id", "org_id", "subject_kind", "subject_id", "body", "text_digest", "embedding",
    "tags", "importance", "claim_type", "valid_from", "valid_until", "author_kind", "author_id",
    "run_id", "on_behalf_of", "created_at", "expires_at", "state", "superseded_by", "erased_at",
)  # fmt: skip
_PERSON_KINDS: Final = ("USER", "CANDIDATE", "EMPLOYEE", "CUSTOMER")


@dataclass(frozen=True)
class Dataset:
    scale: Scale
    url: str
    built_at: datetime
    subject_of_note: Subject  # a person in the measured org with many memories
    small_org: str
    medium_org: str


def _subject_for(index: int, org_size: int) -> tuple[str, str]:
    """A fifth of an org's memories are about the workspace; the rest about people,
    ~50 memories each."""
    if index % 5 == 0:
        return "WORKSPACE", ""
    person = index % max(1, org_size // 50)
    return _PERSON_KINDS[person % 4], f"{_PERSON_KINDS[person % 4].lower()}-{person}"


def _vector_bytes(vector: np.ndarray) -> bytes:
    # pgvector's binary form: dimensions (int16), unused (int16), float4 values, big-endian.
    return struct.pack(">HH", vector.shape[0], 0) + vector.astype(">f4").tobytes()


def _rows(
    *,
    org_id: str,
    sentences: Sequence[str],
    vectors: np.ndarray,
    built_at: datetime,
    rng: random.Random,
) -> Iterator[tuple[Any, ...]]:
    size = len(sentences)
    ids = [uuid.UUID(int=rng.getrandbits(128), version=4) for _ in range(size)]
    for index, text in enumerate(sentences):
        kind, subject_id = _subject_for(index, size)
        created_at = built_at - timedelta(seconds=rng.uniform(0, 80 * 86400))
        draw = rng.random()
        state, superseded_by, erased_at = "ACTIVE", None, None
        valid_from = valid_until = None
        body: str | None = text
        digest: bytes | None = hashlib.sha256(normalised_text(text).encode()).digest()
        embedding: bytes | None = _vector_bytes(vectors[index])
        if draw < 0.05:
            state, superseded_by = "SUPERSEDED", ids[(index + 5) % size]
        elif draw < 0.07:
            state, erased_at, body, digest, embedding = "ERASED", created_at, None, None, None
        elif draw < 0.08:
            valid_from = built_at + timedelta(days=4 * 365)  # not yet valid for years
        elif draw < 0.09:
            valid_from = created_at
            valid_until = created_at + timedelta(hours=1)  # no longer valid
        by_model = index % 3 != 0
        yield (
            ids[index],
            org_id,
            kind,
            subject_id,
            body,
            digest,
            embedding,
            [] if body is None else [rng.choice(_TEAMS)],
            rng.randint(1, 5),
            rng.choice(("UNKNOWN", "USER_STATEMENT", "INFERENCE")),
            valid_from,
            valid_until,
            "MODEL" if by_model else "PERSON",
            "assistant" if by_model else rng.choice(_NAMES).lower(),
            f"run-{rng.getrandbits(40):010x}" if by_model else "",
            rng.choice(_NAMES).lower() if by_model else "",
            created_at,
            built_at + DATASET_TTL,
            state,
            superseded_by,
            erased_at,
        )


def _blended(real: np.ndarray, own: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Vectors near real memories but copies of none: each row's own sentence blended
    with a random other one, plus noise. Plain perturbed copies put ~10 near-identical
    vectors per sentence into the index, and such duplicate clusters split an HNSW
    graph into islands that no real multi-tenant store has at that rate."""
    other = rng.integers(0, real.shape[0], size=own.shape[0])
    mixed = BLEND * real[own] + (1 - BLEND) * real[other]
    mixed += rng.normal(0.0, NOISE_SIGMA, size=mixed.shape).astype(np.float32)
    mixed /= np.linalg.norm(mixed, axis=1, keepdims=True)
    blended: np.ndarray = mixed.astype(np.float32)
    return blended


async def _real_embeddings(sentences: Sequence[str]) -> np.ndarray:
    """The local model's embeddings of the sentence pool, cached under state/bench
    (the slow part of a build: ~500 sentences/s on 2 cores)."""
    cache = STATE / f"memory_sentences_s{SENTENCE_SEED}_{len(sentences)}.npy"
    larger = sorted(STATE.glob(f"memory_sentences_s{SENTENCE_SEED}_*.npy"))
    for path in [cache, *larger]:
        if path.exists():
            cached: np.ndarray = np.load(path)
            if cached.shape[0] >= len(sentences):
                return cached[: len(sentences)]
    console.print(f"  embedding {len(sentences):,} sentences for {MEASURED_ORG} (once) …")
    embedder = LocalOnnxEmbedder(batch_size=64, threads=2)
    started = time.perf_counter()
    real = np.empty((len(sentences), 384), dtype=np.float32)
    step = 4096
    for start in range(0, len(sentences), step):
        chunk = sentences[start : start + step]
        real[start : start + len(chunk)] = np.asarray(await embedder.embed(chunk), dtype=np.float32)
        if start and start % (step * 5) == 0:
            rate = start / (time.perf_counter() - started)
            console.print(f"    {start:,} embedded ({rate:,.0f}/s)")
    np.save(cache, real)
    return real


def _with_database(admin_url: str, database: str) -> str:
    # pgserver URLs look like postgresql://postgres:@/postgres?host=/path
    head, sep, query = admin_url.partition("?")
    base = head.rsplit("/", 1)[0]
    return f"{base}/{database}{sep}{query}"


async def _vector_codec(conn: asyncpg.Connection) -> None:
    schema = await conn.fetchval(
        "SELECT n.nspname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
        "WHERE t.typname = 'vector'"
    )
    await conn.set_type_codec(
        "vector",
        schema=schema,
        encoder=lambda value: value,
        decoder=lambda value: value,
        format="binary",
    )


async def ensure_dataset(scale: Scale) -> Dataset:
    admin_url = start_embedded_postgres(STATE / "pg")
    url = _with_database(admin_url, scale.database)
    admin = await asyncpg.connect(admin_url)
    try:
        exists = await admin.fetchval(
            "SELECT true FROM pg_database WHERE datname = $1", scale.database
        )
        marker = None
        if exists:
            conn = await asyncpg.connect(url)
            try:
                marker = await conn.fetchval(
                    "SELECT detail FROM public.bench_dataset WHERE complete"
                    if await conn.fetchval("SELECT to_regclass('public.bench_dataset') IS NOT NULL")
                    else "SELECT NULL"
                )
            finally:
                await conn.close()
        if marker is None:
            if exists:
                console.print(f"  dataset {scale.database}: incomplete, building it again")
                await admin.execute(f'DROP DATABASE "{scale.database}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{scale.database}"')
            started = time.perf_counter()
            marker = await _build(scale, url)
            console.print(
                f"  dataset {scale.database}: built in {time.perf_counter() - started:,.0f} s"
            )
        else:
            console.print(f"  dataset {scale.database}: reused")
    finally:
        await admin.close()
    # Apply any migration added since the dataset was built before the service
    # starts, so no index build happens inside a measurement.
    await _prepare_for_migrations(url, scale.database)
    console.print(
        "  applying new memory migrations to the dataset, if any (a table rewrite and "
        "index build, e.g. migration 0006, takes a quarter of an hour at 1M rows, once) …"
    )
    started = time.perf_counter()
    database = memory_database(url)
    try:
        if not await database.ready():
            raise RuntimeError(f"the benchmark database {scale.database} is not usable")
    finally:
        await database.close()
    console.print(f"  migrations checked in {time.perf_counter() - started:,.0f} s")
    # A migration that rewrites the table (0006) leaves it without a visibility map
    # or statistics for the new column: every index-only scan then fetches each row
    # from the heap (9k heap fetches for the 10k org, twice), which times the
    # rewrite, not recall. Cheap when nothing changed: all-visible pages are skipped.
    started = time.perf_counter()
    conn = await asyncpg.connect(url, server_settings={"search_path": f"{SCHEMA},public"})
    try:
        await conn.execute("VACUUM (ANALYZE) memories")
    finally:
        await conn.close()
    console.print(f"  vacuumed and analysed in {time.perf_counter() - started:,.0f} s")
    detail = json.loads(marker)
    return Dataset(
        scale=scale,
        url=url,
        built_at=datetime.fromisoformat(detail["built_at"]),
        subject_of_note=Subject(SubjectKind(detail["subject_kind"]), detail["subject_id"]),
        small_org=detail["small_org"],
        medium_org=detail.get("medium_org", "bench-medium-0"),
    )


async def _prepare_for_migrations(url: str, database: str) -> None:
    """Make a new migration's index builds on the 1M rows take minutes, not hours.

    The embedded PostgreSQL's default maintenance_work_mem (64 MB) holds a small part
    of an HNSW graph over 1M vectors (~1 GB); past it pgvector inserts into the index
    on disk, and migration 0006 wrote ~8 MB of index a minute that way (about two
    hours, twice over). So every session of this database, the migrating one
    included, gets the memory the dataset's own build uses. And 0006's table rewrite
    would first rebuild the old expression HNSW index, only for its next statement to
    drop it: while 0006 is pending, that index is swapped for an empty placeholder of
    the same name, which the rewrite rebuilds in no time and 0006 then drops.
    """
    conn = await asyncpg.connect(url, server_settings={"search_path": f"{SCHEMA},public"})
    try:
        await conn.execute(f"ALTER DATABASE \"{database}\" SET maintenance_work_mem = '4GB'")
        await conn.execute(f'ALTER DATABASE "{database}" SET max_parallel_maintenance_workers = 1')
        pending_0006 = not await conn.fetchval(
            "SELECT count(*) > 0 FROM information_schema.columns WHERE table_schema = $1 "
            "AND table_name = 'memories' AND column_name = 'embedding_half'",
            SCHEMA,
        )
        if pending_0006:
            async with conn.transaction():
                await conn.execute("DROP INDEX IF EXISTS memories_embedding_hnsw")
                await conn.execute(
                    "CREATE INDEX memories_embedding_hnsw ON memories (memory_id) WHERE false"
                )
    finally:
        await conn.close()


async def _build(scale: Scale, url: str) -> str:
    database = memory_database(url)
    try:
        if not await database.ready():
            raise RuntimeError("the benchmark database did not migrate")
    finally:
        await database.close()
    built_at = datetime.now(UTC).replace(microsecond=0)
    sentences = unique_sentences(scale.measured, seed=SENTENCE_SEED)
    real = await _real_embeddings(sentences)
    conn = await asyncpg.connect(url, server_settings={"search_path": f"{SCHEMA},public"})
    try:
        await _vector_codec(conn)
        indexes = await conn.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1 "
            "AND tablename = 'memories' AND indexname NOT LIKE '%pkey'",
            SCHEMA,
        )
        for index in indexes:
            await conn.execute(f'DROP INDEX "{SCHEMA}"."{index["indexname"]}"')
        rng = random.Random(DATASET_VERSION)
        noise = np.random.default_rng(DATASET_VERSION)
        loaded = 0
        for org_id, size in scale.orgs():
            if org_id == MEASURED_ORG:
                own = np.arange(size)
                vectors = real[:size]
            else:
                own = noise.choice(len(sentences), size=size, replace=False)
                vectors = _blended(real, own, noise)
            rows = _rows(
                org_id=org_id,
                sentences=[sentences[i] for i in own],
                vectors=vectors,
                built_at=built_at,
                rng=rng,
            )
            batch: list[tuple[Any, ...]] = []
            for row in rows:
                batch.append(row)
                if len(batch) == COPY_CHUNK:
                    await conn.copy_records_to_table(
                        "memories", records=batch, columns=_COLUMNS, schema_name=SCHEMA
                    )
                    batch = []
            if batch:
                await conn.copy_records_to_table(
                    "memories", records=batch, columns=_COLUMNS, schema_name=SCHEMA
                )
            loaded += size
            if size >= scale.measured:
                console.print(f"    {loaded:,} of {scale.total:,} rows loaded")
        console.print(f"  building {len(indexes)} indexes over {scale.total:,} rows …")
        await conn.execute("SET maintenance_work_mem = '5GB'")
        await conn.execute("SET max_parallel_maintenance_workers = 1")
        for index in indexes:
            started = time.perf_counter()
            await conn.execute(index["indexdef"])
            console.print(f"    {index['indexname']}: {time.perf_counter() - started:,.0f} s")
        await conn.execute("VACUUM (ANALYZE) memories")
        person = _subject_for(1, scale.measured)
        detail = json.dumps(
            {
                "version": DATASET_VERSION,
                "built_at": built_at.isoformat(),
                "subject_kind": person[0],
                "subject_id": person[1],
                "small_org": "bench-small-0",
                "medium_org": "bench-medium-0",
                "orgs": len(scale.orgs()),
            }
        )
        await conn.execute(
            "CREATE TABLE public.bench_dataset (detail text NOT NULL, complete boolean NOT NULL)"
        )
        await conn.execute("INSERT INTO public.bench_dataset VALUES ($1, true)", detail)
    finally:
        await conn.close()
    return detail


# --- measuring --------------------------------------------------------------------


async def _timed(call: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _start_memory(url: str) -> tuple[ServiceProcess, TokenIssuer]:
    private_key, public_key = generate_dev_keypair(STATE / "keys")
    proc = start_service(
        "memory",
        port=free_port(),
        env={
            "DATABASE_URL": url,
            "CAIRN_JWT_PUBLIC_KEY_FILE": str(public_key),
            "CAIRN_EMBEDDER": "local",
            # The questions repeat across the measured kinds: with the service's
            # embedding cache on, later kinds would time the cache, not recall.
            "CAIRN_EMBED_CACHE_ENTRIES": "0",
            "CAIRN_LOG_LEVEL": "WARNING",
        },
        log_dir=STATE / "logs",
        suffix="-bench",
    )
    try:
        wait_for_health(proc, timeout=120)
    except BaseException:
        proc.stop()
        raise
    return proc, TokenIssuer.from_file(private_key)


async def _plan(url: str, sql: str, args: Sequence[Any], *, semantic: bool) -> tuple[str, float]:
    """The top index the service's statement uses, and its execution time (EXPLAIN ANALYZE)."""
    conn = await asyncpg.connect(url, server_settings={"search_path": f"{SCHEMA},public"})
    try:
        async with conn.transaction():
            if semantic:
                for setting in SEMANTIC_SETTINGS:
                    await conn.execute(setting)
            rows = await conn.fetch(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args)
    finally:
        await conn.close()
    plan = json.loads(rows[0][0])[0]
    names: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        # The semantic statement holds both branches, gated by the org's size: only
        # the one that ran counts (the other's nodes report no loops).
        if node.get("Actual Loops", 1) == 0:
            return
        if "Index Name" in node:
            names.append(f"{node['Node Type']} using {node['Index Name']}")
        elif node["Node Type"] == "Seq Scan":
            names.append("Seq Scan")
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    # In plan order: the size gate's count, the branch that ranked, the row look-up.
    shown = " + ".join(dict.fromkeys(names)) or plan["Plan"]["Node Type"]
    return shown, float(plan["Execution Time"])


async def _statement_timings(url: str, org_id: str, vectors: Sequence[list[float]]) -> list[float]:
    """The semantic statement alone (settings, query, commit), without gRPC or embedding."""
    conn = await asyncpg.connect(url, server_settings={"search_path": f"{SCHEMA},public"})
    sql = semantic_recall_sql(None)
    samples = []
    try:
        for vector in vectors:
            args = semantic_recall_args(
                org_id=org_id, subject=None, vector=vector, k=K, now=datetime.now(UTC)
            )
            started = time.perf_counter()
            async with conn.transaction():
                await conn.execute("; ".join(SEMANTIC_SETTINGS))
                await conn.fetch(sql, *args)
            samples.append((time.perf_counter() - started) * 1000)
    finally:
        await conn.close()
    return samples


async def _check_exact(url: str, memory_ids: set[str], *, org_id: str) -> None:
    """Every memory any Recall returned must be recallable now and of the caller's org."""
    conn = await asyncpg.connect(url, server_settings={"search_path": f"{SCHEMA},public"})
    try:
        wrong = await conn.fetchval(
            "SELECT count(*) FROM memories WHERE memory_id = ANY($1::uuid[]) AND NOT ("
            "org_id = $2 AND state = 'ACTIVE' AND expires_at > now() "
            "AND (valid_from IS NULL OR valid_from <= now()) "
            "AND (valid_until IS NULL OR valid_until > now()))",
            list(memory_ids),
            org_id,
        )
        found = await conn.fetchval(
            "SELECT count(*) FROM memories WHERE memory_id = ANY($1::uuid[])", list(memory_ids)
        )
    finally:
        await conn.close()
    if wrong or found != len(memory_ids):
        raise RuntimeError(
            f"Recall returned {wrong} memories it must never return "
            f"({len(memory_ids) - found} unknown); the figures would be meaningless"
        )


async def _exact_top_k(url: str, org_id: str, vectors: Sequence[list[float]]) -> list[set[str]]:
    """The true k nearest recallable memories, by a full scan of the org (no HNSW:
    the ORDER BY expression is not the indexed operator)."""
    now = datetime.now(UTC)
    conn = await asyncpg.connect(url, server_settings={"search_path": f"{SCHEMA},public"})
    sql = semantic_recall_sql(None, exact=True)
    try:
        truth = []
        for vector in vectors:
            rows = await conn.fetch(
                sql, *semantic_recall_args(org_id=org_id, subject=None, vector=vector, k=K, now=now)
            )
            truth.append({str(r["memory_id"]) for r in rows})
    finally:
        await conn.close()
    return truth


async def run_memory(*, quick: bool = False) -> list[Figure]:
    scale = QUICK if quick else FULL
    n = 150 if quick else 1000
    remember_total = 200 if quick else 1500
    concurrency = 8
    dataset = await ensure_dataset(scale)
    loadavg = round(os.getloadavg()[0], 2)
    proc, issuer = _start_memory(dataset.url)
    remember_org = f"bench-remember-{uuid.uuid4().hex[:8]}"
    returned: dict[str, set[str]] = {}
    try:
        ch = channel(proc.address)
        stub = memory_pb2_grpc.MemoryServiceStub(ch)
        reader = call_metadata(issuer.caller_token(org_id=MEASURED_ORG, user_id="bench-reader"))
        asked = questions(n, seed=DATASET_VERSION + 1)
        subject = memory_pb2.Subject(
            kind=memory_pb2.SubjectKind.Value(f"SUBJECT_KIND_{dataset.subject_of_note.kind.value}"),
            id=dataset.subject_of_note.id,
        )
        position = 0

        def recall(
            *, query: bool, org_id: str, about: memory_pb2.Subject | None
        ) -> Callable[[], Awaitable[None]]:
            metadata = call_metadata(issuer.caller_token(org_id=org_id, user_id="bench-reader"))

            async def call() -> None:
                nonlocal position
                text = asked[position % n] if query else ""
                position += 1
                response = await stub.Recall(
                    memory_pb2.RecallRequest(query=text, k=K, subject=about),
                    metadata=metadata,
                    timeout=30,
                )
                expected = (
                    memory_pb2.RECALL_MODE_SEMANTIC
                    if query
                    else memory_pb2.RECALL_MODE_NEWEST_FIRST
                )
                if response.mode != expected or len(response.memories) != K:
                    raise RuntimeError(
                        f"Recall answered mode {response.mode} with {len(response.memories)} "
                        f"memories; expected mode {expected} with {K}"
                    )
                returned.setdefault(org_id, set()).update(m.memory_id for m in response.memories)

            return call

        semantic = recall(query=True, org_id=MEASURED_ORG, about=None)
        newest = recall(query=False, org_id=MEASURED_ORG, about=None)
        semantic_subject = recall(query=True, org_id=MEASURED_ORG, about=subject)
        semantic_small = recall(query=True, org_id=dataset.small_org, about=None)
        semantic_medium = recall(query=True, org_id=dataset.medium_org, about=None)
        for warm in (semantic, newest, semantic_subject, semantic_small, semantic_medium):
            await _timed(warm, 20)
        console.print(f"  recall: {n} queries per kind …")
        semantic_ms = await _timed(semantic, n)
        newest_ms = await _timed(newest, n)
        subject_ms = await _timed(semantic_subject, n // 2)
        small_ms = await _timed(semantic_small, n // 2)
        medium_ms = await _timed(semantic_medium, n // 2)

        remaining = n
        concurrent_ms: list[float] = []

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                concurrent_ms.extend(await _timed(semantic, 1))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        recall_rps = n / (time.perf_counter() - started)

        # Quality and plans, beside the timings.
        embedder = LocalOnnxEmbedder()
        sample = asked[: 50 if quick else 100]
        vectors = await embedder.embed(sample)
        truth = await _exact_top_k(dataset.url, MEASURED_ORG, vectors)
        hits = 0
        for text, expected_ids in zip(sample, truth, strict=True):
            response = await stub.Recall(
                memory_pb2.RecallRequest(query=text, k=K), metadata=reader, timeout=30
            )
            hits += len(expected_ids & {m.memory_id for m in response.memories})
        recall_at_k = hits / (K * len(sample))
        now = datetime.now(UTC)
        sql_ms = await _statement_timings(dataset.url, MEASURED_ORG, vectors)
        plan_semantic, _ = await _plan(
            dataset.url,
            semantic_recall_sql(None),
            semantic_recall_args(
                org_id=MEASURED_ORG, subject=None, vector=vectors[0], k=K, now=now
            ),
            semantic=True,
        )
        plan_small, _ = await _plan(
            dataset.url,
            semantic_recall_sql(None),
            semantic_recall_args(
                org_id=dataset.small_org, subject=None, vector=vectors[0], k=K, now=now
            ),
            semantic=True,
        )
        plan_medium, _ = await _plan(
            dataset.url,
            semantic_recall_sql(None),
            semantic_recall_args(
                org_id=dataset.medium_org, subject=None, vector=vectors[0], k=K, now=now
            ),
            semantic=True,
        )
        plan_newest, _ = await _plan(
            dataset.url,
            newest_recall_sql(None),
            newest_recall_args(org_id=MEASURED_ORG, subject=None, k=K, now=now),
            semantic=False,
        )
        for org_id, memory_ids in returned.items():
            await _check_exact(dataset.url, memory_ids, org_id=org_id)

        # Remember: one sentence each, embedded and stored by the service.
        writer = call_metadata(issuer.caller_token(org_id=remember_org, user_id="bench-writer"))
        to_remember = unique_sentences(remember_total + 20, seed=DATASET_VERSION + 2)
        cursor = 0

        async def remember() -> None:
            nonlocal cursor
            text = to_remember[cursor]
            cursor += 1
            response = await stub.Remember(
                memory_pb2.RememberRequest(
                    text=text, subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE)
                ),
                metadata=writer,
                timeout=60,
            )
            if response.already_held:
                raise RuntimeError(f"bench sentence {text!r} was already held")

        await _timed(remember, 20)
        remember_ms: list[float] = []
        left = remember_total

        async def remember_worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                remember_ms.extend(await _timed(remember, 1))

        started = time.perf_counter()
        await asyncio.gather(*(remember_worker() for _ in range(concurrency)))
        remember_per_s = remember_total / (time.perf_counter() - started)
        await ch.close(None)
    finally:
        proc.stop()
        conn = await asyncpg.connect(
            dataset.url, server_settings={"search_path": f"{SCHEMA},public"}
        )
        try:
            await conn.execute("DELETE FROM memories WHERE org_id = $1", remember_org)
        finally:
            await conn.close()

    data = {
        "org_memories": scale.measured,
        "total_memories": scale.total,
        "orgs": len(scale.orgs()),
        "dataset": f"v{DATASET_VERSION}",
        "k": K,
    }
    seq = {**data, "mode": "sequential via gRPC, query embedding included"}
    hnsw = dict(s.split(" = ") for s in (x.removeprefix("SET LOCAL ") for x in SEMANTIC_SETTINGS))
    return [
        Figure(
            "memory.recall.semantic.p50",
            percentile(semantic_ms, 50),
            "ms",
            {
                **seq,
                "dataset": (
                    f"v{DATASET_VERSION}: measured org = real MiniLM embeddings of generated "
                    "sentences; other orgs = COPY-loaded synthetic vectors (0.6 own + 0.4 "
                    "random other real embedding + noise); 5% superseded, 2% erased, "
                    "2% outside validity"
                ),
                "queries": n,
                "plan": plan_semantic,
                **hnsw,
                "target_p50_ms": 15,
                "loadavg_1m_at_start": loadavg,
            },
        ),
        Figure(
            "memory.recall.semantic.p99", percentile(semantic_ms, 99), "ms", {**seq, "queries": n}
        ),
        Figure(
            "memory.recall.semantic.sql.p50",
            percentile(sql_ms, 50),
            "ms",
            {
                **data,
                "queries": len(sql_ms),
                "what": "the service's settings and statement alone, over one connection",
            },
        ),
        Figure(
            "memory.recall.semantic.recall_at_5",
            recall_at_k,
            "ratio",
            {**data, "queries": len(sample), "against": "exact scan of the org's recallable rows"},
        ),
        Figure(
            "memory.recall.semantic_one_subject.p50",
            percentile(subject_ms, 50),
            "ms",
            {**seq, "queries": n // 2, "subject_memories": 50},
        ),
        Figure(
            "memory.recall.semantic_medium_org.p50",
            percentile(medium_ms, 50),
            "ms",
            {**seq, "queries": n // 2, "org_memories": scale.measured // 10, "plan": plan_medium},
        ),
        Figure(
            "memory.recall.semantic_medium_org.p99",
            percentile(medium_ms, 99),
            "ms",
            {**seq, "queries": n // 2, "org_memories": scale.measured // 10},
        ),
        Figure(
            "memory.recall.semantic_small_org.p50",
            percentile(small_ms, 50),
            "ms",
            {**seq, "queries": n // 2, "org_memories": scale.measured // 100, "plan": plan_small},
        ),
        Figure(
            "memory.recall.semantic_small_org.p99",
            percentile(small_ms, 99),
            "ms",
            {**seq, "queries": n // 2, "org_memories": scale.measured // 100},
        ),
        Figure(
            "memory.recall.newest_first.p50",
            percentile(newest_ms, 50),
            "ms",
            {**seq, "queries": n, "plan": plan_newest},
        ),
        Figure(
            "memory.recall.newest_first.p99", percentile(newest_ms, 99), "ms", {**seq, "queries": n}
        ),
        Figure(
            "memory.recall.semantic.concurrent_rps",
            recall_rps,
            "req/s",
            {
                **data,
                "concurrency": concurrency,
                "queries": n,
                "p99_ms": round(percentile(concurrent_ms, 99), 2),
            },
        ),
        Figure(
            "memory.remember.per_second",
            remember_per_s,
            "memories/s",
            {
                **data,
                "concurrency": concurrency,
                "memories": remember_total,
                "p50_ms": round(percentile(remember_ms, 50), 2),
                "what": "Remember via gRPC: screening, embedding, insert into the same table",
            },
        ),
    ]
