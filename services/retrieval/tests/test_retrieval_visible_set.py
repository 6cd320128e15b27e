"""BM25 over the caller's visible set, and non-interference (DESIGN I2): a
caller's answer is a function only of the documents that caller may see."""

from __future__ import annotations

import math
import random
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs.identity import TokenIssuer
from cairn_retrieval.tokens import tokenize

if TYPE_CHECKING:
    from conftest import RunningRetrieval

VOCAB = [
    "ledger", "audit", "invoice", "vendor", "payment", "refund", "budget",
    "quarter", "forecast", "travel", "policy", "approval", "the", "and", "of",
]  # fmt: skip
SOURCES = ["finance", "legal", "ops"]
GROUPS = ["g1", "g2", "g3", "g4"]
CALLER = "bob"


@dataclass(frozen=True)
class Spec:
    """A generated document: who may see it is decided by source, users, groups."""

    document_id: str
    source: str
    text: str
    users: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()

    def to_proto(self) -> retrieval_pb2.Document:
        return retrieval_pb2.Document(
            document_id=self.document_id,
            source=self.source,
            title=self.document_id.upper(),
            text=self.text,
            acl=retrieval_pb2.Acl(users=list(self.users), groups=list(self.groups)),
        )

    def visible_to(self, groups: set[str], sources: set[str]) -> bool:
        return self.source in sources and (CALLER in self.users or bool(groups & set(self.groups)))


def reference_bm25(
    texts: dict[str, str], query: str, *, k1: float = 1.2, b: float = 0.75
) -> dict[str, float]:
    """Okapi BM25 of every text holding a query term, from the textbook formula,
    sharing nothing with the service but its tokenizer."""
    docs = {key: Counter(tokenize(text)) for key, text in texts.items()}
    n = len(docs)
    if n == 0:
        return {}
    lengths = {key: sum(tf.values()) for key, tf in docs.items()}
    avgdl = sum(lengths.values()) / n
    terms = sorted(set(tokenize(query)))
    df = {t: sum(1 for tf in docs.values() if t in tf) for t in terms}
    scores: dict[str, float] = {}
    for key, tf in docs.items():
        if not any(t in tf for t in terms):
            continue
        total = 0.0
        for t in terms:
            if t in tf:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                total += idf * tf[t] * (k1 + 1) / (tf[t] + k1 * (1 - b + b * lengths[key] / avgdl))
        scores[key] = total
    return scores


def fingerprint(response: retrieval_pb2.SearchResponse) -> tuple[object, ...]:
    """Everything a caller can observe in a search answer."""
    return (
        response.mode,
        response.mode_reason,
        len(response.results),
        [
            (
                r.document_id, r.chunk_id, r.source, r.title, r.char_start, r.char_end,
                r.text, r.bm25_score, r.dense_score, r.fused_score, r.keyword_rank, r.dense_rank,
            )
            for r in response.results
        ],
    )  # fmt: skip


def _ingester(issuer: TokenIssuer, org_id: str) -> str:
    return issuer.caller_token(org_id=org_id, user_id="loader", roles=["ingester"])


def _caller(issuer: TokenIssuer, org_id: str, groups: Sequence[str]) -> str:
    return issuer.caller_token(org_id=org_id, user_id=CALLER, groups=list(groups))


def _random_corpus(rng: random.Random, size: int) -> list[Spec]:
    corpus = []
    for i in range(size):
        words = [rng.choice(VOCAB) for _ in range(rng.randint(1, 30))]
        corpus.append(
            Spec(
                document_id=f"doc-{i:03d}",
                source=rng.choice(SOURCES[:2]),
                text=" ".join(words) + rng.choice([".", "!", ""]),
                users=(CALLER,) if rng.random() < 0.1 else (),
                groups=tuple(rng.sample(GROUPS, rng.randint(0, 2))),
            )
        )
    return corpus


def _check_bm25_against_reference(
    service: RunningRetrieval, issuer: TokenIssuer, seed: int, *, keyword_only: bool
) -> None:
    rng = random.Random(seed)
    org_id = f"org-bm25-{uuid.uuid4().hex[:8]}"
    corpus = _random_corpus(rng, 70)
    ingested = service.client.ingest(_ingester(issuer, org_id), [s.to_proto() for s in corpus])
    assert all(r.result.chunks == 1 for r in ingested)
    # The same documents in another org, all visible there: they must not count here.
    service.client.ingest(
        _ingester(issuer, org_id + "-twin"),
        [replace(s, groups=("g1",)).to_proto() for s in corpus],
    )
    groups, sources = {"g1", "g2"}, {"finance"}
    query = " ".join(rng.sample(VOCAB[:12], 3))

    answer = service.client.search(
        _caller(issuer, org_id, sorted(groups)), query, sorted(sources), k=50
    )

    visible = {s.document_id: s.text for s in corpus if s.visible_to(groups, sources)}
    reference = reference_bm25(visible, query)
    keyword_hits = [r for r in answer.results if r.keyword_rank]
    assert keyword_hits, "the corpus should give the query some keyword hits"
    for hit in keyword_hits:
        assert abs(hit.bm25_score - reference[hit.document_id]) <= 1e-6
    if keyword_only:
        expected = sorted(reference.items(), key=lambda kv: (-kv[1], kv[0]))[:50]
        assert [r.document_id for r in answer.results] == [d for d, _ in expected]
        assert [r.keyword_rank for r in answer.results] == list(range(1, len(expected) + 1))
    # Statistics over the whole org would give other scores: the check can fail.
    whole_org = reference_bm25(
        {s.document_id: s.text for s in corpus if s.source in sources}, query
    )
    assert any(abs(whole_org[h.document_id] - h.bm25_score) > 1e-6 for h in keyword_hits)


def test_bm25_scores_and_order_equal_a_reference_over_the_callers_visible_set(
    keyword_retrieval: RunningRetrieval, issuer: TokenIssuer
) -> None:
    for seed in (11, 23, 47, 90):
        _check_bm25_against_reference(keyword_retrieval, issuer, seed, keyword_only=True)


def test_hybrid_results_carry_the_same_reference_bm25_scores(
    retrieval: RunningRetrieval, issuer: TokenIssuer
) -> None:
    _check_bm25_against_reference(retrieval, issuer, 5, keyword_only=False)


# ---------------------------------------------------------------- non-interference

_text = st.lists(st.sampled_from(VOCAB), min_size=1, max_size=25).map(" ".join)


@st.composite
def _scenario(draw: st.DrawFn) -> dict[str, object]:
    caller_groups = sorted(draw(st.sets(st.sampled_from(GROUPS), min_size=1, max_size=2)))
    sources = sorted(draw(st.sets(st.sampled_from(SOURCES), min_size=1, max_size=2)))
    outside = [g for g in GROUPS if g not in caller_groups]
    base: list[Spec] = []
    for i in range(draw(st.integers(2, 8))):
        if i < 2:  # some of the corpus is always visible
            spec = Spec(
                f"doc-{i}", draw(st.sampled_from(sources)), draw(_text), groups=(caller_groups[0],)
            )
        else:
            spec = Spec(
                f"doc-{i}",
                draw(st.sampled_from(SOURCES)),
                draw(_text),
                users=tuple(draw(st.sets(st.sampled_from([CALLER, "mallory"]), max_size=1))),
                groups=tuple(draw(st.sets(st.sampled_from(GROUPS), max_size=2))),
            )
        base.append(spec)

    def forbidden(document_id: str) -> Spec:
        # Forbidden either by ACL (no key of the caller) or by source (not asked for).
        if draw(st.booleans()) or len(sources) == len(SOURCES):
            return Spec(
                document_id,
                draw(st.sampled_from(SOURCES)),
                draw(_text),
                users=("mallory",),
                groups=tuple(draw(st.sets(st.sampled_from(outside), max_size=2))),
            )
        other_sources = [s for s in SOURCES if s not in sources]
        return Spec(
            document_id,
            draw(st.sampled_from(other_sources)),
            draw(_text),
            users=(CALLER,),
            groups=tuple(caller_groups),
        )

    invisible = [s for s in base if not s.visible_to(set(caller_groups), set(sources))]
    changed = [replace(s, text=draw(_text)) for s in invisible if draw(st.booleans())]
    deleted = [s.document_id for s in invisible if s not in changed and draw(st.booleans())]
    added = [forbidden(f"new-{i}") for i in range(draw(st.integers(1, 3)))]
    # Same ids, sources and the caller's own keys, but another org: forbidden by tenancy.
    twin = [replace(s, users=(CALLER,), groups=tuple(caller_groups)) for s in added]
    return {
        "caller_groups": caller_groups,
        "sources": sources,
        "query": " ".join(draw(st.lists(st.sampled_from(VOCAB), min_size=1, max_size=3))),
        "base": base,
        "changed": changed,
        "deleted": deleted,
        "added": added,
        "twin": twin,
    }


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario=_scenario())
def test_adding_changing_or_deleting_forbidden_documents_changes_nothing_a_caller_sees(
    retrieval: RunningRetrieval, issuer: TokenIssuer, scenario: dict[str, object]
) -> None:
    client = retrieval.client
    org_id = f"org-i2-{uuid.uuid4().hex[:10]}"
    ingester = _ingester(issuer, org_id)
    caller = _caller(issuer, org_id, scenario["caller_groups"])  # type: ignore[arg-type]
    sources: list[str] = scenario["sources"]  # type: ignore[assignment]
    query: str = scenario["query"]  # type: ignore[assignment]
    client.ingest(ingester, [s.to_proto() for s in scenario["base"]])  # type: ignore[attr-defined]

    before = client.search(caller, query, sources, k=10)

    client.ingest(ingester, [s.to_proto() for s in scenario["added"]])  # type: ignore[attr-defined]
    client.ingest(ingester, [s.to_proto() for s in scenario["changed"]])  # type: ignore[attr-defined]
    for document_id in scenario["deleted"]:  # type: ignore[attr-defined]
        client.delete(ingester, document_id)
    client.ingest(
        _ingester(issuer, org_id + "-twin"),
        [s.to_proto() for s in scenario["twin"]],  # type: ignore[attr-defined]
    )

    after = client.search(caller, query, sources, k=10)

    assert len(before.results) >= 1
    assert fingerprint(after) == fingerprint(before)
