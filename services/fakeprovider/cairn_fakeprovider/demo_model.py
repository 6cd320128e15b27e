"""What does the offline demo model answer, given only the request?

The orchestrator fences data into the last user message and hands search results
back as tool messages; this module reads those conventions and decides, with no I/O
and no randomness, whether to search first or to answer from what it was given:

  - the person asks what is known about them ("what do you know about me", "你知道
    我什么") and `recall_memory` is offered: call it for the person asking;
  - the person asks to remember something ("remember that …", "请记住…") and
    `remember` is offered: call it with their words, as their own statement about
    themselves (the orchestrator then shows the person a card to approve);
  - the person asks about open positions (or leave days) and the people
    directory's `count_open_positions` (or `leave_balance`) is offered: call it
    with no arguments, so the directory narrows by the person's own token;
  - otherwise a `search_knowledge` tool is offered and nothing came back from a tool
    since the last user message: call it with the question;
  - after a tool result, answer from it: what was kept (or that the person declined),
    what is held about the person, what the directory counted (or that it said the
    person may not see it), or the first labelled knowledge item, citing its
    label; or say plainly that nothing readable was found (and which tool failed,
    with its code). Memory answers are in Chinese when the question is.

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
REMEMBER_TOOL = "remember"
RECALL_TOOL = "recall_memory"
OPEN_POSITIONS_TOOL = "count_open_positions"
LEAVE_TOOL = "leave_balance"
# The people directory's own code for "you may not see that".
DIRECTORY_DENIAL_CODE = "permission_denied"
DENIED_CODE = "tool.denied"
MAX_MEMORY_CHARS = 300

# "What do you know about me?" and its kin, in English and Chinese. Asked first: a
# question about what is remembered is not a request to remember.
_ASKS_WHAT_IS_KNOWN = (
    re.compile(
        r"\bwhat\b.{0,40}\b(?:know|remember|recall|hold|keep|kept|stored?)\b.{0,20}"
        r"\b(?:about|of)\s+me\b",
        re.IGNORECASE,
    ),
    re.compile(
        r"\bwhat\s+(?:have|did)\s+(?:you|i)\b.{0,20}\b(?:remember(?:ed)?|told?)\b", re.IGNORECASE
    ),
    re.compile(r"(?:关于我|对我|你).{0,8}(?:知道|记得|记住|了解|保存).{0,8}(?:什么|哪些|多少)"),
    re.compile(r"你.{0,6}(?:记得|记住|知道)(?:了)?(?:我|关于我).{0,8}(?:什么|哪些|吗)"),
)
# Questions the demo people directory answers, in English and Chinese.
_ASKS_OPEN_POSITIONS = re.compile(
    r"\bopen\s+(?:positions?|roles?|jobs?|reqs?)\b|\bvacanc(?:y|ies)\b|空缺|职位|招聘",
    re.IGNORECASE,
)
_ASKS_LEAVE_BALANCE = re.compile(
    r"\bleave\b.{0,30}\b(?:left|balance|remaining)\b|\b(?:days?|balance)\b.{0,20}\bleave\b"
    r".{0,20}\b(?:left|have|remaining)\b|假期余额|年假|剩.{0,4}(?:假|天)",
    re.IGNORECASE,
)
# "Please remember that …", "记住…": the words after it are what to keep.
_ASKS_TO_REMEMBER = (
    re.compile(
        r"(?:^|[.!?]\s+)(?:please\s+|(?:can|could|would|will)\s+you\s+(?:please\s+)?)?"
        r"(?:remember|keep\s+in\s+mind|don'?t\s+forget)\b[\s,:]+(?:that\s+)?(?P<text>\S.*)",
        re.IGNORECASE | re.DOTALL,
    ),
    re.compile(r"(?:记住|记下|记一下|别忘了)[\s，,：:]*(?P<text>\S.*)", re.DOTALL),
)
_HAN = re.compile(r"[\u4e00-\u9fff]")

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

    if not tool_messages:
        first_call = _first_tool_call(request, fenced.question)
        if first_call is not None:
            return Reply(content=None, tool_calls=(first_call,))

    names = _tool_names_by_call_id(request.messages)
    answered = [names.get(message.tool_call_id or "", "") for message in tool_messages]
    chinese = bool(_HAN.search(fenced.question))
    if REMEMBER_TOOL in answered:
        message = tool_messages[answered.index(REMEMBER_TOOL)]
        return Reply(content=compose_remembered(message.content, chinese=chinese))
    if RECALL_TOOL in answered:
        message = tool_messages[answered.index(RECALL_TOOL)]
        return Reply(content=compose_recalled(message.content, chinese=chinese))
    for tool in (OPEN_POSITIONS_TOOL, LEAVE_TOOL):
        if tool in answered:
            message = tool_messages[answered.index(tool)]
            return Reply(content=compose_directory(message.content, tool=tool, chinese=chinese))
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


def _may_call(request: ChatRequest, tool: str) -> bool:
    if not request.offers_tool(tool) or request.tool_choice == "none":
        return False
    return request.forced_tool in (None, tool)


def _may_search(request: ChatRequest) -> bool:
    return _may_call(request, SEARCH_TOOL)


def asks_what_is_known(question: str) -> bool:
    return any(pattern.search(question) for pattern in _ASKS_WHAT_IS_KNOWN)


def words_to_remember(question: str) -> str | None:
    """What the person asked to be remembered, on one line and within the remember
    tool's limit; None when they asked for nothing to be remembered."""
    for pattern in _ASKS_TO_REMEMBER:
        found = pattern.search(question)
        if found is not None:
            # "Can you remember that I am vegetarian?" keeps a statement, not a question.
            text = " ".join(found["text"].split()).strip().rstrip("?？").rstrip()
            if len(text) > MAX_MEMORY_CHARS:
                text = text[: MAX_MEMORY_CHARS - 1].rstrip() + "…"
            return text or None
    return None


def _first_tool_call(request: ChatRequest, question: str) -> PlannedToolCall | None:
    """The call to make before anything came back from a tool, if any."""
    if asks_what_is_known(question) and _may_call(request, RECALL_TOOL):
        return PlannedToolCall(RECALL_TOOL, _json({"query": "", "subject": {"kind": "USER"}}))
    text = words_to_remember(question)
    if text is not None and _may_call(request, REMEMBER_TOOL):
        arguments = {"text": text, "subject": {"kind": "USER"}, "claim_type": "USER_STATEMENT"}
        return PlannedToolCall(REMEMBER_TOOL, _json(arguments))
    if _ASKS_OPEN_POSITIONS.search(question) and _may_call(request, OPEN_POSITIONS_TOOL):
        return PlannedToolCall(OPEN_POSITIONS_TOOL, "{}")
    if _ASKS_LEAVE_BALANCE.search(question) and _may_call(request, LEAVE_TOOL):
        return PlannedToolCall(LEAVE_TOOL, "{}")
    if _may_search(request):
        return PlannedToolCall(SEARCH_TOOL, _json({"query": question}))
    return None


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _tool_payload(content: str) -> object:
    fenced = read_fenced_message(content).blocks
    if fenced:
        content = fenced[0].body.partition("\n")[2]
    try:
        return json.loads(content)
    except ValueError:
        return None


def _error_code(payload: object) -> str | None:
    if not isinstance(payload, dict) or "error" not in payload:
        return None
    error = payload["error"]
    return str(error.get("code", "unknown")) if isinstance(error, dict) else str(error)


def compose_remembered(content: str, *, chinese: bool) -> str:
    """The answer after `remember` came back: kept, declined by the person, or failed."""
    payload = _tool_payload(content)
    code = _error_code(payload)
    if code == DENIED_CODE:
        said = (
            "好的，你没有批准，所以我没有保存。"
            if chinese
            else "Understood: you declined, so I kept nothing."
        )
    elif code is not None:
        said = (
            f"没能保存：remember 工具失败，错误代码 {code}。"
            if chinese
            else f"I could not keep it: the remember tool failed with error code {code}."
        )
    elif isinstance(payload, dict) and payload.get("kept"):
        text = str(payload.get("text", ""))
        until = str(payload.get("kept_until", ""))
        if chinese:
            said = f"我会记住：“{text}”" + (f"（保存至 {until}）。" if until else "。")
        else:
            said = f'I will remember: "{text}"' + (f" (kept until {until})." if until else ".")
    elif isinstance(payload, dict) and payload.get("kept") is False:
        note = str(payload.get("note") or "")
        said = f"没能保存：{note}。" if chinese else f"I could not keep it: {note}."
    else:
        said = "我不确定是否已保存。" if chinese else "I could not tell whether it was kept."
    return OFFLINE_PREFIX + said


def compose_recalled(content: str, *, chinese: bool) -> str:
    """The answer after `recall_memory` came back: each memory and profile fact held
    about the person, with where it came from, or that nothing is held."""
    payload = _tool_payload(content)
    code = _error_code(payload)
    if code is not None or not isinstance(payload, dict):
        return OFFLINE_PREFIX + (
            f"没能查到：recall_memory 工具失败，错误代码 {code}。"
            if chinese
            else f"I could not look: the recall_memory tool failed with error code {code}."
        )
    lines: list[str] = []
    for memory in payload.get("memories") or ():
        if isinstance(memory, dict) and memory.get("text"):
            origin = str(memory.get("origin", ""))
            lines.append(f'"{memory["text"]}"' + (f" ({origin})" if origin else ""))
    for fact in payload.get("profile") or ():
        if isinstance(fact, dict) and fact.get("key"):
            lines.append(f"{fact['key']}: {fact.get('value', '')}")
    if not lines:
        return OFFLINE_PREFIX + (
            "我还没有保存任何关于你的信息。" if chinese else "I hold nothing about you yet."
        )
    head = "我保存的关于你的信息：" if chinese else "What I hold about you: "
    return OFFLINE_PREFIX + head + "; ".join(lines)


def compose_directory(content: str, *, tool: str, chinese: bool) -> str:
    """The answer after a people-directory tool came back: the count or the balance,
    that the directory says the person may not see it, or which error it gave."""
    payload = _tool_payload(content)
    code = _error_code(payload)
    if code is not None and code.endswith(DIRECTORY_DENIAL_CODE):
        return OFFLINE_PREFIX + (
            "人员目录说你无权查看这些信息。"
            if chinese
            else "The people directory says you may not see that."
        )
    if code is not None or not isinstance(payload, dict):
        return OFFLINE_PREFIX + (
            f"没能查到：{tool} 工具失败，错误代码 {code}。"
            if chinese
            else f"I could not look: the {tool} tool failed with error code {code}."
        )
    if tool == OPEN_POSITIONS_TOOL and "total" in payload:
        total = payload["total"]
        return OFFLINE_PREFIX + (
            f"你的团队共有 {total} 个空缺职位。"
            if chinese
            else f"Your teams have {total} open positions."
        )
    if tool == LEAVE_TOOL and "days_left" in payload:
        days = payload["days_left"]
        return OFFLINE_PREFIX + (
            f"你还剩 {days} 天假期。" if chinese else f"You have {days} days of leave left."
        )
    return OFFLINE_PREFIX + (
        f"{tool} 的回答我读不懂。" if chinese else f"I could not read what {tool} answered."
    )


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
