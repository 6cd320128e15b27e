"""The readable text of an HTML page, for ingesting documentation as documents.

Block elements become paragraph breaks, so the chunker can cut where the page
does; scripts, styles and navigation (`nav`, `header`, `footer`, and the
navigation blocks DocBook and Sphinx generate) are dropped, since they repeat
on every page and would only add noise to BM25 and the embeddings. The
standard library's parser is enough: no page is trusted to be well formed, and
nothing here runs or fetches anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser

_SKIPPED_TAGS = frozenset({"script", "style", "nav", "header", "footer", "head", "noscript"})
_SKIPPED_CLASSES = frozenset({
    "navheader", "navfooter", "sphinxsidebar", "related", "footer", "headerlink",
})  # fmt: skip
_BLOCK_TAGS = frozenset({
    "p", "div", "section", "article", "br", "li", "ul", "ol", "dl", "dt", "dd", "pre",
    "table", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "hr", "title",
})  # fmt: skip
_VOID_TAGS = frozenset({"br", "hr", "img", "meta", "link", "input", "col", "area", "base", "wbr"})
_HEADING = re.compile(r"h[1-6]")


@dataclass(frozen=True, slots=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True, slots=True)
class HtmlPage:
    title: str
    text: str
    headings: tuple[Heading, ...]


class _Extractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._parts: list[str] = []
        self._skip_stack: list[str] = []
        self._in_title = False
        self._title: list[str] = []
        self._heading: tuple[int, list[str]] | None = None
        self.headings: list[Heading] = []
        self._pre_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        if self._skip_stack:
            if tag not in _VOID_TAGS:
                self._skip_stack.append(tag)
            return
        classes = set((dict(attrs).get("class") or "").split())
        if tag in _SKIPPED_TAGS or classes & _SKIPPED_CLASSES:
            if tag not in _VOID_TAGS:
                self._skip_stack.append(tag)
            return
        if tag == "pre":
            self._pre_depth += 1
        if tag in _BLOCK_TAGS:
            self._parts.append("\n\n")
        if _HEADING.fullmatch(tag):
            self._heading = (int(tag[1]), [])

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if self._skip_stack:
            # Pop to the matching open tag; unclosed inner tags close with it.
            if tag in self._skip_stack:
                while self._skip_stack and self._skip_stack.pop() != tag:
                    pass
            return
        if tag == "pre" and self._pre_depth:
            self._pre_depth -= 1
        if _HEADING.fullmatch(tag) and self._heading is not None:
            text = _squash(" ".join(self._heading[1]))
            if text:
                self.headings.append(Heading(self._heading[0], text))
            self._heading = None
        if tag in _BLOCK_TAGS:
            self._parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self._title.append(data)
        if self._skip_stack:
            return
        if self._heading is not None:
            self._heading[1].append(data)
        self._parts.append(data if self._pre_depth else re.sub(r"\s+", " ", data))

    def page(self) -> HtmlPage:
        raw = "".join(self._parts)
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", raw)]
        text = "\n\n".join(p for p in paragraphs if p)
        return HtmlPage(
            title=_squash(" ".join(self._title)), text=text, headings=tuple(self.headings)
        )


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def html_to_page(html: str) -> HtmlPage:
    """Title, readable text and headings of `html`."""
    extractor = _Extractor()
    extractor.feed(html)
    extractor.close()
    return extractor.page()
