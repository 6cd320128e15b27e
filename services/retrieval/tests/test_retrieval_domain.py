"""The pure parts of retrieval: tokenizer, chunker, document checks, fusion, mode."""

from __future__ import annotations

import re

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn_libs.errors import DENIAL_MESSAGE, status_for
from cairn_libs.identity import Principal
from cairn_retrieval import bm25
from cairn_retrieval.chunking import chunk_text, estimated_tokens
from cairn_retrieval.domain import (
    DEFAULT_K,
    MAX_K,
    NO_EMBEDDER_REASON,
    VECTOR_STORE_UNREACHABLE_REASON,
    DenseStatus,
    DocumentAcl,
    IncomingDocument,
    RankedHit,
    SearchMode,
    candidate_pool,
    content_hash,
    decide_mode,
    fuse_rrf,
    may_manage,
    point_id,
    prepare_document,
    rank,
    resolve_k,
    validate_document,
)
from cairn_retrieval.errors import (
    BadDocument,
    BadSearch,
    DatabaseUnavailable,
    DenseSearchUnavailable,
    DocumentNotVisible,
    EmbedderFailed,
    RetrievalError,
    VectorStoreUnavailable,
)
from cairn_retrieval.tokens import (
    NO_STEMMING,
    Analyzer,
    SourceAnalyzers,
    parse_source_languages,
    query_terms,
    term_frequencies,
    text_length,
    tokenize,
)

# ---------------------------------------------------------------- tokens


def test_tokenize_lowercases_splits_on_punctuation_drops_stopwords_and_stems() -> None:
    assert tokenize("The Quick-brown fox_jumps, and IS fast!") == [
        "quick",
        "brown",
        "fox",
        "jump",
        "fast",
    ]


def test_one_stem_stands_for_the_forms_of_a_word_in_text_and_query_alike() -> None:
    forms = "connect connected connecting connection connections"
    assert set(tokenize(forms)) == {"connect"}
    assert query_terms("Connecting") == ["connect", "title:connect"]


def test_without_stemming_words_stay_whole() -> None:
    plain = Analyzer(NO_STEMMING)
    assert plain.tokenize("The connections, connecting") == ["connections", "connecting"]
    assert plain.name == "plain" and Analyzer().name == "snowball-english"


def test_another_language_stems_with_its_own_rules_and_no_english_stopwords() -> None:
    german = Analyzer("german")
    assert german.tokenize("Die Häuser und das Haus") == ["die", "haus", "und", "das", "haus"]


def test_an_unknown_language_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'klingon' has no stemmer"):
        Analyzer("klingon")
    with pytest.raises(ValueError, match="'klingon' \\(for source 'wiki'\\)"):
        parse_source_languages("handbook=english, wiki=klingon")
    assert parse_source_languages("handbook=english, code=none,") == {
        "handbook": "english",
        "code": "none",
    }


def test_a_search_over_sources_of_two_languages_asks_for_both_stems() -> None:
    analyzers = SourceAnalyzers(default="english", per_source={"code": "none"})
    assert analyzers.query_terms("running", ["docs"]) == ["run", "title:run"]
    assert analyzers.query_terms("running", ["docs", "code"]) == [
        "run",
        "running",
        "title:run",
        "title:running",
    ]


def test_tokenize_keeps_words_and_digits_of_any_script() -> None:
    assert Analyzer(NO_STEMMING).tokenize("Straße Ünïcode 東京 2024 ﬁne") == [
        "strasse",
        "ünïcode",
        "東京",
        "2024",
        "fine",
    ]


def test_tokenize_drops_runs_longer_than_a_word_can_be() -> None:
    assert tokenize("short " + "x" * 65) == ["short"]


def test_query_terms_count_a_repeated_word_once_as_text_and_as_title() -> None:
    assert query_terms("travel Travel the travel policy") == [
        "polici",
        "title:polici",
        "title:travel",
        "travel",
    ]


def test_title_terms_are_their_own_and_do_not_count_in_the_length() -> None:
    counts = term_frequencies("Meals are reimbursed.", title="Meals policy")
    assert counts == {"meal": 1, "reimburs": 1, "title:meal": 1, "title:polici": 1}
    assert text_length(counts) == 2


# ---------------------------------------------------------------- chunking

_words = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_separators = st.sampled_from([" ", "  ", "\n", "\n\n", " \n \n", "\t", ". ", "! "])


@st.composite
def _texts(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.tuples(_words, _separators), max_size=600))
    return "".join(w + s for w, s in parts)


@settings(max_examples=150, deadline=None, database=None)
@given(_texts())
def test_every_chunk_is_an_exact_span_of_the_text_and_together_they_cover_every_word(
    text: str,
) -> None:
    spans = chunk_text(text)
    words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
    if not words:
        assert spans == []
        return
    assert [s.ordinal for s in spans] == list(range(len(spans)))
    for span in spans:
        chunk = text[span.char_start : span.char_end]
        assert chunk and chunk == chunk.strip()
        assert (
            sum(estimated_tokens(w) for w in chunk.split()) <= 256 + 1e-9 or len(chunk.split()) == 1
        )
    assert spans[0].char_start == words[0][0]
    assert spans[-1].char_end == words[-1][1]
    for before, after in zip(spans, spans[1:], strict=False):
        assert before.char_start < after.char_start
        # Consecutive chunks touch or overlap: no word falls between them.
        assert (
            after.char_start <= before.char_end
            or not text[before.char_end : after.char_start].strip()
        )


def _paragraph(n: int, word: str) -> str:
    return " ".join(f"{word}{i}" for i in range(n - 1)) + " end."


def test_chunks_end_at_a_paragraph_break_when_one_leaves_a_chunk_large_enough() -> None:
    first, second, third = (
        _paragraph(120, "alpha"),
        _paragraph(120, "beta"),
        _paragraph(60, "gamma"),
    )
    text = f"{first}\n\n{second}\n\n{third}"
    spans = chunk_text(text)
    assert text[spans[0].char_start : spans[0].char_end] == first
    assert len(spans) >= 2


def test_consecutive_chunks_overlap_by_about_the_overlap_budget() -> None:
    text = " ".join(f"w{i}" for i in range(1000))
    spans = chunk_text(text)
    assert len(spans) > 3
    for before, after in zip(spans, spans[1:], strict=False):
        shared = text[after.char_start : before.char_end].split()
        assert 20 <= len(shared) <= 25  # 32 tokens / 1.3 per word


def test_a_short_document_is_one_chunk() -> None:
    assert [(s.char_start, s.char_end) for s in chunk_text("  hello world \n")] == [(2, 13)]


def test_a_word_longer_than_a_chunk_is_cut_into_pieces() -> None:
    spans = chunk_text("a" * 3000)
    assert [(s.char_start, s.char_end) for s in spans] == [(0, 1024), (1024, 2048), (2048, 3000)]


# ---------------------------------------------------------------- documents


def _doc(**changes: object) -> IncomingDocument:
    fields: dict[str, object] = {
        "document_id": "policy-7",
        "source": "handbook",
        "title": "Policy",
        "text": "Some text.",
        "acl": DocumentAcl(groups=("staff",)),
        "metadata": {"lang": "en"},
    }
    fields.update(changes)
    return IncomingDocument(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"document_id": ""}, "document_id is empty"),
        ({"document_id": "new\nline"}, "'new\\nline'"),
        ({"document_id": "trailing "}, "'trailing '"),
        ({"document_id": "x" * 513}, "1-512 printable characters"),
        ({"source": ""}, "no source"),
        ({"source": "bad/source"}, "'bad/source'"),
        ({"text": "   \n"}, "no text"),
        ({"text": "a\x00b"}, "NUL"),
        ({"acl": DocumentAcl(users=("two words",))}, "'two words'"),
    ],
)
def test_a_bad_document_is_refused_naming_the_bad_value(
    changes: dict[str, object], names: str
) -> None:
    with pytest.raises(BadDocument) as caught:
        validate_document(_doc(**changes))
    assert names in caught.value.message


def test_a_good_document_passes_validation() -> None:
    validate_document(_doc(document_id="team/a:b@c+d=e-f_g.h"))
    for document_id in ("_exit.2", "guide#install", "100% done", "日本語の頁"):
        validate_document(_doc(document_id=document_id))


def test_content_hash_changes_with_text_acl_title_source_or_metadata_and_nothing_else() -> None:
    base = content_hash(_doc())
    assert content_hash(_doc()) == base
    for changes in (
        {"text": "Other text."},
        {"acl": DocumentAcl(groups=("admins",))},
        {"title": "Other"},
        {"source": "wiki"},
        {"metadata": {"lang": "de"}},
    ):
        assert content_hash(_doc(**changes)) != base


def test_prepared_chunks_carry_exact_text_terms_and_versioned_ids() -> None:
    doc = _doc(text="Travel travel policy.\n\nMeals are reimbursed.")
    prepared = prepare_document("org-1", doc)
    (chunk,) = prepared.chunks
    assert chunk.text == doc.text[chunk.char_start : chunk.char_end]
    assert chunk.term_frequencies == {
        "travel": 2,
        "polici": 1,
        "meal": 1,
        "reimburs": 1,
        "title:polici": 1,
    }
    assert chunk.length == 5
    assert chunk.embedded_text == "Policy\n\n" + chunk.text
    assert chunk.chunk_id.startswith("policy-7#") and chunk.chunk_id.endswith("-00000")
    assert (prepared.analyzer, prepared.chunking) == ("snowball-english", "estimate/256/title32")
    other = prepare_document("org-1", doc, analyzer=Analyzer(NO_STEMMING))
    assert other.content_hash == prepared.content_hash
    assert other.chunks[0].chunk_id != chunk.chunk_id
    assert prepared.acl_keys == ("group:staff",)


def test_point_ids_are_stable_and_differ_between_orgs() -> None:
    assert point_id("org-a", "d#1") == point_id("org-a", "d#1")
    assert point_id("org-a", "d#1") != point_id("org-b", "d#1")


def test_only_ingesters_and_admins_may_manage_a_corpus() -> None:
    assert may_manage(Principal("o", "u", roles=("ingester",)))
    assert may_manage(Principal("o", "u", roles=("admin",)))
    assert not may_manage(Principal("o", "u", roles=("reader",), groups=("ingester",)))


# ---------------------------------------------------------------- search


def test_k_defaults_to_four_and_is_bounded() -> None:
    assert resolve_k(0) == DEFAULT_K == 4
    assert resolve_k(MAX_K) == 50
    for bad in (-1, 51):
        with pytest.raises(BadSearch):
            resolve_k(bad)


def test_candidate_pool_is_at_least_twenty_and_five_per_result() -> None:
    assert candidate_pool(4) == 20
    assert candidate_pool(10) == 50


def test_rank_orders_by_score_then_chunk_id() -> None:
    assert [h.chunk_id for h in rank([("b", 1.0), ("a", 1.0), ("c", 2.0)])] == ["c", "a", "b"]


def test_rrf_sums_reciprocal_ranks_of_both_lists() -> None:
    keyword = [RankedHit("a", 9.0), RankedHit("b", 5.0)]
    dense = [RankedHit("b", 0.9), RankedHit("c", 0.8)]
    fused = fuse_rrf(keyword, dense, limit=10)
    assert [h.chunk_id for h in fused] == ["b", "a", "c"]
    b = fused[0]
    assert b.fused_score == 1 / 62 + 1 / 61
    assert (b.keyword_rank, b.dense_rank, b.bm25_score, b.dense_score) == (2, 1, 5.0, 0.9)
    assert (fused[2].keyword_rank, fused[2].bm25_score) == (0, 0.0)


def test_rrf_breaks_ties_by_chunk_id_and_honours_the_limit() -> None:
    fused = fuse_rrf([RankedHit("z", 1.0)], [RankedHit("y", 1.0)], limit=1)
    assert [h.chunk_id for h in fused] == ["y"]


@pytest.mark.parametrize(
    ("dense", "terms", "mode", "reason"),
    [
        (DenseStatus.AVAILABLE, True, SearchMode.HYBRID, ""),
        (DenseStatus.NO_EMBEDDER, True, SearchMode.KEYWORD_ONLY, NO_EMBEDDER_REASON),
        (
            DenseStatus.VECTOR_STORE_UNREACHABLE,
            True,
            SearchMode.KEYWORD_ONLY,
            VECTOR_STORE_UNREACHABLE_REASON,
        ),
        (DenseStatus.AVAILABLE, False, SearchMode.DENSE_ONLY, "dense-only"),
    ],
)
def test_mode_states_which_half_is_missing_and_why(
    dense: DenseStatus, terms: bool, mode: SearchMode, reason: str
) -> None:
    got_mode, got_reason = decide_mode(dense=dense, has_query_terms=terms)
    assert got_mode is mode
    assert reason in got_reason and bool(reason) == bool(got_reason)


def test_reasons_read_exactly_as_the_contract_says() -> None:
    assert NO_EMBEDDER_REASON == "no embedder is configured; these results are keyword-only"
    assert VECTOR_STORE_UNREACHABLE_REASON == (
        "the vector store is unreachable; these results are keyword-only"
    )


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (BadDocument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (BadSearch("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (DatabaseUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (VectorStoreUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (EmbedderFailed("x"), grpc.StatusCode.UNAVAILABLE),
        (DenseSearchUnavailable("x"), grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_every_retrieval_error_maps_to_its_status_code(
    error: RetrievalError, code: grpc.StatusCode
) -> None:
    assert status_for(error) == (code, "x")


def test_a_document_not_found_reads_as_the_one_denial_with_the_not_found_code() -> None:
    assert status_for(DocumentNotVisible()) == (grpc.StatusCode.PERMISSION_DENIED, DENIAL_MESSAGE)


def test_a_title_term_weighs_a_fixed_share_of_a_text_term_with_the_same_df() -> None:
    stats = bm25.VisibleStatistics(
        chunks=100, total_length=1000, document_frequencies={"leav": 5, "title:leav": 5}
    )
    text, title = bm25.term_weights(stats)
    assert (text.term, title.term) == ("leav", "title:leav")
    assert title.idf == pytest.approx(text.idf * bm25.TITLE_WEIGHT)
    assert 0 < bm25.TITLE_WEIGHT < 1
