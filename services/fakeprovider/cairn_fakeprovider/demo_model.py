"""What does the offline demo model answer, given only the request?

The orchestrator fences data into the last user message and hands search results
back as tool messages; this module reads those conventions and decides, with no I/O
and no randomness, whether to search first or to answer from what it was given:

  - a `search_knowledge` tool is offered and nothing came back from a tool since the
    last user message: call it with the question;
  - otherwise answer from the first labelled knowledge item, citing its label, or
    say plainly that nothing readable was found (and which tool failed, with its code).

Every answer starts with OFFLINE_PREFIX so nobody mistakes the demo for a real model.
A fence closes only on an END line carrying its own nonce; text inside that merely
looks like an END line stays data, which is the point of the nonce.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .chat_wire import ChatMessage, ChatRequest
from .reply import OFFLINE_PREFIX, PlannedToolCall, Reply

SEARCH_TOOL = "search_knowledge"

_FENCE_OPEN = re.compile(
    r"^<<<CAIRN-DATA kind=(?P<kind>[A-Za-z0-9_-]+) nonce=(?P<nonce>[0-9A-Fa-f]+)>>>$"
)
_FENCE_CLOSE = re.compile(r"^<<<END-CAIRN-DATA nonce=(?P<nonce>[0-9A-Fa-f]+)>>>$")
_ITEM_LABEL = re.compile(r"^\[(?P<label>[A-Za-z]{1,4}[0-9]{1,4})\]\s*(?P<title>.*)$")
_SOURCE_SUFFIX = re.compile(r"\s*\(source:[^)]*\)\s*$")
# Chunk text may itself contain "[S7]"; echoing it would cite a label nobody gave us.
_LABEL_LOOKALIKE = re.compile(r"\[[A-Za-z]{1,4}[0-9]{1,4}\]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_EXCERPT_LIMIT = 280
_MAX_SENTENCES = 2


@dataclass(frozen=True)
class DataBlock:
    kind: str
    nonce: str
    body: str


@dataclass(frozen=True)
class FencedMessage:
    blocks: tuple[DataBlock, ...]
    question: str


@dataclass(frozen=True)
class KnowledgeItem:
    label: str
    title: str
    text: str


@dataclass(frozen=True)
class ToolFailure:
    tool: str
    code: str


def read_fenced_message(text: str) -> FencedMessage:
    """Separate the fenced data blocks of a user message from the person's question."""
    lines = text.split("\n")
    blocks: list[DataBlock] = []
    outside: list[str] = []
    after_last_block: list[str] = []
    index = 0
    while index < len(lines):
        opening = _FENCE_OPEN.match(lines[index].strip())
        if opening is not None:
            close_at = _matching_close(lines, start=index + 1, nonce=opening["nonce"])
            if close_at is not None:
                body = "\n".join(lines[index + 1 : close_at])
                blocks.append(DataBlock(kind=opening["kind"], nonce=opening["nonce"], body=body))
                after_last_block = []
                index = close_at + 1
                continue
        outside.append(lines[index])
        after_last_block.append(lines[index])
        index += 1
    question = "\n".join(after_last_block).strip()
    if not question:
        # An orchestrator that puts the question before its data still gets answered.
        question = "\n".join(outside).strip()
    return FencedMessage(blocks=tuple(blocks), question=question)


def _matching_close(lines: Sequence[str], *, start: int, nonce: str) -> int | None:
    for index in range(start, len(lines)):
        closing = _FENCE_CLOSE.match(lines[index].strip())
        if closing is not None and closing["nonce"] == nonce:
            return index
    return None


def knowledge_items_in_block(body: str) -> list[KnowledgeItem]:
    """Read `[S1] Title (source: x)` headers and the chunk text under each."""
    items: list[KnowledgeItem] = []
    label: str | None = None
    title = ""
    text_lines: list[str] = []
    for line in body.split("\n"):
        header = _ITEM_LABEL.match(line.strip())
        if header is not None:
            if label is not None:
                items.append(KnowledgeItem(label, title, "\n".join(text_lines).strip()))
            label = header["label"]
            title = _SOURCE_SUFFIX.sub("", header["title"]).strip()
            text_lines = []
        elif label is not None:
            text_lines.append(line)
    if label is not None:
        items.append(KnowledgeItem(label, title, "\n".join(text_lines).strip()))
    return items


def read_tool_result(content: str, *, tool: str) -> tuple[list[KnowledgeItem], ToolFailure | None]:
    """Read one tool message: labelled results, an error, or nothing we understand.
    A fenced result (cairn fences every tool result) is read from inside its fence."""
    fenced = read_fenced_message(content).blocks
    if fenced:
        # The block's first line is the fence's own "this is data" preamble.
        content = fenced[0].body.partition("\n")[2]
    try:
        payload = json.loads(content)
    except ValueError:
        return [], None
    if not isinstance(payload, dict):
        return [], None
    error = payload.get("error")
    if isinstance(error, dict):
        return [], ToolFailure(tool=tool, code=str(error.get("code", "unknown")))
    if isinstance(error, str):
        return [], ToolFailure(tool=tool, code=error)
    results = payload.get("results")
    items: list[KnowledgeItem] = []
    if isinstance(results, list):
        for result in results:
            if isinstance(result, dict) and isinstance(result.get("label"), str):
                items.append(
                    KnowledgeItem(
                        label=result["label"],
                        title=str(result.get("title") or ""),
                        text=str(result.get("text") or ""),
                    )
                )
    return items, None


def _last_user_index(messages: Sequence[ChatMessage]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "user":
            return index
    return None


def _tool_names_by_call_id(messages: Iterable[ChatMessage]) -> dict[str, str]:
    return {call.id: call.name for message in messages for call in message.tool_calls}


def leading_sentences(text: str, *, limit: int = _EXCERPT_LIMIT) -> str:
    """One or two sentences from the start of `text`, cut at a word if very long."""
    flat = " ".join(_LABEL_LOOKALIKE.sub("", text).split())
    sentences = _SENTENCE_END.split(flat)
    excerpt = sentences[0]
    for sentence in sentences[1:_MAX_SENTENCES]:
        if len(excerpt) + 1 + len(sentence) > limit:
            break
        excerpt = f"{excerpt} {sentence}"
    if len(excerpt) > limit:
        excerpt = excerpt[:limit].rsplit(" ", 1)[0] + "…"
    return excerpt


def plan_reply(request: ChatRequest) -> Reply:
    """The default, deterministic behaviour of the offline demo model."""
    last_user = _last_user_index(request.messages)
    if last_user is None:
        return Reply(content=f'{OFFLINE_PREFIX}I found nothing I may read about "".')
    fenced = read_fenced_message(request.messages[last_user].content)
    since_user = request.messages[last_user + 1 :]
    tool_messages = [message for message in since_user if message.role == "tool"]

    if not tool_messages and _may_search(request):
        arguments = json.dumps(
            {"query": fenced.question}, ensure_ascii=False, separators=(",", ":")
        )
        return Reply(content=None, tool_calls=(PlannedToolCall(SEARCH_TOOL, arguments),))

    names = _tool_names_by_call_id(request.messages)
    items: list[KnowledgeItem] = []
    failures: list[ToolFailure] = []
    for message in tool_messages:
        tool = names.get(message.tool_call_id or "", "unknown")
        found, failure = read_tool_result(message.content, tool=tool)
        items.extend(found)
        if failure is not None:
            failures.append(failure)
    for block in fenced.blocks:
        if block.kind == "knowledge":
            items.extend(knowledge_items_in_block(block.body))
    return Reply(content=compose_answer(question=fenced.question, items=items, failures=failures))


def _may_search(request: ChatRequest) -> bool:
    if not request.offers_tool(SEARCH_TOOL) or request.tool_choice == "none":
        return False
    return request.forced_tool in (None, SEARCH_TOOL)


def compose_answer(
    *, question: str, items: Sequence[KnowledgeItem], failures: Sequence[ToolFailure]
) -> str:
    parts = [
        f"The {failure.tool} tool failed with error code {failure.code}." for failure in failures
    ]
    if items:
        first = items[0]
        excerpt = leading_sentences(first.text or first.title or "(empty passage)")
        parts.append(f"{excerpt} [{first.label}]")
    else:
        parts.append(f'I found nothing I may read about "{question}".')
    return OFFLINE_PREFIX + " ".join(parts)
