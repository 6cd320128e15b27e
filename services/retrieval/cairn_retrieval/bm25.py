"""How a BM25 search decides which postings it must read: term weights from the
caller's visible-set statistics, and MaxScore's split of the query terms into
the ones a top-k chunk must contain and the ones that only add to a score.

Okapi BM25 with k1 = 1.2, b = 0.75:

    score(c) = sum over query terms t in c of
               w(t) * idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))
    idf(t)   = ln(1 + (N - df + 0.5) / (df + 0.5))

where w(t) is 1 for a term of the text and TITLE_WEIGHT for a title term.

The tf part is below k1 + 1 for every chunk, so `(k1 + 1) * idf(t)` bounds what
term t can add to any score. Small queries are scored exhaustively in one
pass. Otherwise a search runs two passes:

1. Find a threshold: read the rarest terms' postings, take the `limit` chunks
   with the best partial score over those terms, and score just them in full
   (a handful of index probes). The lowest of those exact scores, theta, is a
   lower bound of the final limit-th best score: they are real visible chunks.
2. Sort the terms by bound, ascending. The longest prefix whose bounds sum to
   less than theta is non-essential: a chunk holding only those terms scores
   below theta and cannot be in the answer. Read the posting lists of the
   essential terms; a chunk whose essential part plus the non-essential bounds
   stays below theta is dropped without further reads, and the rest get their
   non-essential terms looked up one chunk at a time. An index probe costs
   about as much as reading PROBE_COST postings of a list, so pass 2 prunes
   only when probing every chunk of the essential lists would still cost less
   than reading the non-essential lists; otherwise (or when nothing is
   non-essential) pass 2 is the exhaustive pass. Pass 1 is skipped when even
   the rarest term alone could not pass that test.

Why not the obvious alternatives: WAND-style skipping needs document-at-a-time
cursors, which SQL does not give; impact-ordered postings need avgdl and idf at
write time, and both depend on the caller's visible set.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from cairn_retrieval.tokens import TITLE_PREFIX

BM25_K1 = 1.2
BM25_B = 0.75
# A title word is repeated in every chunk of its document, so at full weight a
# page whose title holds a query word outranks the page that answers it. 0.3 was
# chosen on the quality bench's corpora (bench/retrieval_quality.py), so for this
# one setting they are not held out: 1.0 lost 0.02-0.07 nDCG@10, 0.1-0.3 gained.
TITLE_WEIGHT = 0.3

# Pass 1 reads the rarest terms' postings, adding terms while it reads fewer
# than this many (and always the rarest).
FIRST_PASS_POSTINGS = 2000
# At most this many visible postings in all: one exhaustive pass is cheaper
# than planning.
EXHAUSTIVE_POSTINGS = 6000
# What one index probe for a (chunk, term) costs, in postings read from a list:
# measured at about 15 us against 0.3 us on the benchmark corpus.
PROBE_COST = 40

_MARGIN = 1e-9


@dataclass(frozen=True, slots=True)
class VisibleStatistics:
    """N, total length and document frequencies over one caller's visible set."""

    chunks: int
    total_length: int
    document_frequencies: Mapping[str, int]

    @property
    def average_length(self) -> float:
        return self.total_length / self.chunks if self.chunks else 0.0


@dataclass(frozen=True, slots=True)
class TermWeight:
    term: str
    df: int
    idf: float

    @property
    def upper_bound(self) -> float:
        """More than this term can add to any chunk's score."""
        return (BM25_K1 + 1) * self.idf


def idf(chunks: int, df: int) -> float:
    return math.log(1 + (chunks - df + 0.5) / (df + 0.5))


def field_weight(term: str) -> float:
    """A title term (tokens.TITLE_PREFIX) counts TITLE_WEIGHT of a text term."""
    return TITLE_WEIGHT if term.startswith(TITLE_PREFIX) else 1.0


def term_weights(stats: VisibleStatistics) -> list[TermWeight]:
    """The query terms that occur in the visible set, in term order, their idf
    scaled by their field's weight."""
    return [
        TermWeight(term, df, idf(stats.chunks, df) * field_weight(term))
        for term, df in sorted(stats.document_frequencies.items())
        if df > 0
    ]


def term_contribution(weight: TermWeight, *, tf: int, length: int, average_length: float) -> float:
    """One term's share of a chunk's score, with the same operations in the same
    order as the SQL, for tests and pure reference use."""
    return (
        weight.idf
        * tf
        * (BM25_K1 + 1)
        / (tf + BM25_K1 * (1 - BM25_B + BM25_B * length / average_length))
    )


@dataclass(frozen=True, slots=True)
class Pass:
    """One scoring pass: read `essential` terms' postings; keep the chunks whose
    essential part plus `rest_bound` reaches `floor` (or, with `best_partial`,
    the chunks with the best essential parts, that many); look up `rest` terms
    for those; every chunk scored holds at least one essential term."""

    essential: tuple[str, ...]
    rest: tuple[str, ...]
    rest_bound: float
    floor: float
    best_partial: int | None = None

    @property
    def prunes(self) -> bool:
        return self.floor > -math.inf


def exhaustive(weights: Sequence[TermWeight]) -> Pass:
    return Pass(tuple(w.term for w in weights), (), 0.0, -math.inf)


def _probing_pays(essential_postings: int, rest: int, rest_postings: int, probe_cost: int) -> bool:
    return essential_postings * rest * probe_cost <= rest_postings


def first_pass(
    weights: Sequence[TermWeight],
    limit: int,
    *,
    budget: int = FIRST_PASS_POSTINGS,
    exhaustive_below: int = EXHAUSTIVE_POSTINGS,
    probe_cost: int = PROBE_COST,
) -> Pass | None:
    """The threshold pass, or None when one exhaustive pass is the whole search."""
    total = sum(w.df for w in weights)
    if total <= exhaustive_below or len(weights) < 2:
        return None
    rarest_first = sorted(weights, key=lambda w: (w.df, w.term))
    rarest = rarest_first[0].df
    if not _probing_pays(rarest, len(weights) - 1, total - rarest, probe_cost):
        return None
    chosen: list[TermWeight] = []
    read = 0
    for weight in rarest_first[:-1]:
        if chosen and (read + weight.df > budget or read >= 2 * limit):
            break
        chosen.append(weight)
        read += weight.df
    names = {w.term for w in chosen}
    return Pass(
        essential=tuple(sorted(names)),
        rest=tuple(w.term for w in weights if w.term not in names),
        rest_bound=math.inf,
        floor=-math.inf,
        best_partial=limit,
    )


def pruning_floor(theta: float) -> float:
    return theta - abs(theta) * _MARGIN


def second_pass(
    weights: Sequence[TermWeight],
    theta: float | None,
    *,
    probe_cost: int = PROBE_COST,
) -> Pass:
    """The pass that makes the answer exact, given theta (the lowest exact score
    among `limit` chunks pass 1 scored; None if it found fewer)."""
    if theta is None:
        return exhaustive(weights)
    floor = pruning_floor(theta)
    ascending = sorted(weights, key=lambda w: (w.upper_bound, w.term))
    non_essential: list[TermWeight] = []
    bound = 0.0
    for weight in ascending:
        if bound + weight.upper_bound >= floor:
            break
        non_essential.append(weight)
        bound += weight.upper_bound
    names = {w.term for w in non_essential}
    essential = [w for w in weights if w.term not in names]
    if not names or not _probing_pays(
        sum(w.df for w in essential), len(names), sum(w.df for w in non_essential), probe_cost
    ):
        return exhaustive(weights)
    return Pass(
        essential=tuple(w.term for w in essential),
        rest=tuple(w.term for w in weights if w.term in names),
        rest_bound=bound,
        floor=floor,
    )


def top(scores: Mapping[str, float], limit: int) -> list[tuple[str, float]]:
    """Best first, equal scores by chunk id, at most `limit`."""
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]


def limit_th_score(scores: Sequence[float], limit: int) -> float | None:
    if len(scores) < limit:
        return None
    return sorted(scores, reverse=True)[limit - 1]


@dataclass(frozen=True, slots=True)
class SearchTrace:
    """Which passes a search ran, for spans and the benchmark."""

    passes: int
    pruned: bool


async def top_chunks(
    weights: Sequence[TermWeight],
    limit: int,
    score: Callable[[Pass], Awaitable[Mapping[str, float]]],
    *,
    budget: int = FIRST_PASS_POSTINGS,
    exhaustive_below: int = EXHAUSTIVE_POSTINGS,
    probe_cost: int = PROBE_COST,
) -> tuple[list[tuple[str, float]], SearchTrace]:
    """The exact top `limit` by BM25. `score` reads postings as a Pass says and
    returns the full scores of at least the best `limit` chunks it keeps, ties
    included."""
    if not weights:
        return [], SearchTrace(passes=0, pruned=False)
    first = first_pass(
        weights, limit, budget=budget, exhaustive_below=exhaustive_below, probe_cost=probe_cost
    )
    if first is None:
        return top(await score(exhaustive(weights)), limit), SearchTrace(1, pruned=False)
    theta = limit_th_score(list((await score(first)).values()), limit)
    second = second_pass(weights, theta, probe_cost=probe_cost)
    return top(await score(second), limit), SearchTrace(2, pruned=second.prunes)
