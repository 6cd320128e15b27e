"""Which terms a text holds, for BM25: one analyzer per language, used for
documents and queries alike, so the two can never disagree about what a word is.

Lowercase (Unicode casefold after NFKC), runs of Unicode letters and digits,
then, for English, a small stopword list, then the language's Snowball stemmer
(PyStemmer), so "connections", "connected" and "connecting" are one term. The
language is a setting per source (CAIRN_RETRIEVAL_LANGUAGE, and
CAIRN_RETRIEVAL_SOURCE_LANGUAGES for exceptions); `none` keeps words whole, for
corpora of names or code where a stemmer would only merge what differs.

A document's title is indexed too, as separate terms (`title:<term>`, which no
word of a text can spell, since ':' splits words), with their own document
frequencies: a title word is evidence of its own kind, and a chunk's length
(BM25's dl) stays the length of its text, so a title neither inflates nor
shortens what its chunks' words score. A query asks for each of its terms both
ways.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping

import Stemmer  # type: ignore[import-not-found]  # PyStemmer ships no type hints

# Letters and digits of any script; underscore and punctuation split words.
_WORD = re.compile(r"[^\W_]+")

# Longer runs are base64 blobs, hashes or minified code: noise for BM25 and a
# cost for the postings table.
MAX_TERM_CHARS = 64

TITLE_PREFIX = "title:"
NO_STEMMING = "none"
DEFAULT_LANGUAGE = "english"
LANGUAGES: frozenset[str] = frozenset(Stemmer.algorithms()) | {NO_STEMMING}

STOPWORDS: frozenset[str] = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "from", "has",
    "have", "he", "her", "his", "i", "if", "in", "into", "is", "it", "its", "of",
    "on", "or", "our", "she", "so", "that", "the", "their", "them", "then", "there",
    "these", "they", "this", "to", "was", "we", "were", "what", "when", "where",
    "which", "who", "will", "with", "you", "your",
})  # fmt: skip


class Analyzer:
    """Words to terms for one language."""

    def __init__(self, language: str = DEFAULT_LANGUAGE) -> None:
        if language not in LANGUAGES:
            raise ValueError(
                f"language {language!r} has no stemmer; use one of {', '.join(sorted(LANGUAGES))}"
            )
        self.language = language
        # The stopword list is English; `none` keeps it, as cairn always had.
        self._stopwords = (
            STOPWORDS if language in ("english", "porter", NO_STEMMING) else frozenset()
        )
        self._stemmer = None if language == NO_STEMMING else Stemmer.Stemmer(language)

    @property
    def name(self) -> str:
        """What documents.analyzer records: postings made by another analyzer
        are rewritten when the document is ingested or reindexed again."""
        return "plain" if self._stemmer is None else f"snowball-{self.language}"

    def tokenize(self, text: str) -> list[str]:
        """The terms of `text`, in order, repeats kept."""
        folded = unicodedata.normalize("NFKC", text).casefold()
        words = [
            word
            for word in _WORD.findall(folded)
            if word not in self._stopwords and len(word) <= MAX_TERM_CHARS
        ]
        if self._stemmer is None:
            return words
        return [term for term in self._stemmer.stemWords(words) if term]

    def term_frequencies(self, text: str, *, title: str = "") -> Counter[str]:
        """A chunk's terms: its text's, and its document title's under TITLE_PREFIX."""
        counts = Counter(self.tokenize(text))
        counts.update(TITLE_PREFIX + term for term in self.tokenize(title))
        return counts

    def query_terms(self, query: str) -> list[str]:
        """Distinct terms of a query, each as a text term and a title term, sorted:
        a repeated query word counts once."""
        terms = set(self.tokenize(query))
        return sorted(terms | {TITLE_PREFIX + term for term in terms})


def text_length(term_frequencies: Mapping[str, int]) -> int:
    """BM25's document length: the text's terms, repeats counted, not the title's."""
    return sum(n for term, n in term_frequencies.items() if not term.startswith(TITLE_PREFIX))


class SourceAnalyzers:
    """The analyzer of each source: one default language, and exceptions."""

    def __init__(
        self, *, default: str = DEFAULT_LANGUAGE, per_source: Mapping[str, str] | None = None
    ) -> None:
        self.default = Analyzer(default)
        self._per_source = {s: Analyzer(lang) for s, lang in (per_source or {}).items()}

    def for_source(self, source: str) -> Analyzer:
        return self._per_source.get(source, self.default)

    def query_terms(self, query: str, sources: Iterable[str]) -> list[str]:
        """The query's terms under every analyzer of the sources searched: one
        language's stems never miss another source's."""
        analyzers = {self.for_source(s).name: self.for_source(s) for s in sources}
        return sorted({t for a in analyzers.values() for t in a.query_terms(query)})


DEFAULT_ANALYZER = Analyzer()


def tokenize(text: str) -> list[str]:
    """The default analyzer's terms of `text` (English, stemmed)."""
    return DEFAULT_ANALYZER.tokenize(text)


def term_frequencies(text: str, *, title: str = "") -> Counter[str]:
    return DEFAULT_ANALYZER.term_frequencies(text, title=title)


def query_terms(query: str) -> list[str]:
    return DEFAULT_ANALYZER.query_terms(query)


def parse_source_languages(value: str) -> dict[str, str]:
    """`handbook=english,code=none` as a mapping; ValueError naming what is wrong."""
    languages: dict[str, str] = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        source, sep, language = (x.strip() for x in item.partition("="))
        if not sep or not source or not language:
            raise ValueError(f"{item!r} is not source=language")
        if language not in LANGUAGES:
            raise ValueError(
                f"{language!r} (for source {source!r}) has no stemmer; use one of "
                f"{', '.join(sorted(LANGUAGES))}"
            )
        languages[source] = language
    return languages
