"""The built-in `search_knowledge` tool: more retrieval, during the run, with the
agent's sources only.

The model chooses the query, never the corpora (I7): the sources come from the
spec through the tool context, and a `sources` field the model adds to its
arguments is accepted by the schema and then ignored, so a model cannot even learn
by an error which corpora exist. An agent whose spec names no sources reads
nothing, and retrieval is not called at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cairn_orchestrator.domain import ErrorValue, LabelledChunk
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.ports import KnowledgeSearch
from cairn_orchestrator.tools import Tool, ToolContext, ToolResult

SEARCH_KNOWLEDGE = "search_knowledge"
SEARCH_K = 4
KNOWLEDGE_UNAVAILABLE = "knowledge.unavailable"

SEARCH_KNOWLEDGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {
            "type": "string",
            "minLength": 1,
            "maxLength": 2000,
            "description": "What to look for, in the words the documents would use.",
        }
    },
    "required": ["query"],
}


def knowledge_result(
    entries: tuple[LabelledChunk, ...], *, mode: str, mode_reason: str
) -> dict[str, Any]:
    """The content the model reads: labelled passages it may cite as [S<n>]."""
    return {
        "results": [
            {
                "label": entry.label,
                "title": entry.chunk.title,
                "text": entry.chunk.text,
                "source": entry.chunk.source,
                "document_id": entry.chunk.document_id,
                "chunk_id": entry.chunk.chunk_id,
            }
            for entry in entries
        ],
        "mode": mode,
        "mode_reason": mode_reason,
    }


def search_knowledge_tool(
    retrieval: KnowledgeSearch | None, *, k: int = SEARCH_K, timeout_seconds: float = 15.0
) -> Tool:
    async def handler(
        arguments: Mapping[str, Any], context: ToolContext
    ) -> ToolResult | ErrorValue:
        query = str(arguments["query"])
        if not context.sources:
            # I7: an empty list means no knowledge, never "everything".
            return ToolResult(
                content=knowledge_result(
                    (), mode="NONE", mode_reason="this agent reads no knowledge sources"
                )
            )
        if retrieval is None:
            return ErrorValue(
                KNOWLEDGE_UNAVAILABLE, "this deployment has no retrieval service configured"
            )
        try:
            outcome = await retrieval.search(
                query=query,
                sources=context.sources,
                k=k,
                credentials=context.credentials,
                deadline_seconds=timeout_seconds,
            )
        except DependencyFailed as exc:
            return ErrorValue(
                KNOWLEDGE_UNAVAILABLE, f"the knowledge search is unavailable ({exc.status_code})"
            )
        entries = tuple(context.labels.label(chunk) for chunk in outcome.results)
        return ToolResult(
            content=knowledge_result(entries, mode=outcome.mode, mode_reason=outcome.mode_reason),
            knowledge=entries,
        )

    return Tool(
        name=SEARCH_KNOWLEDGE,
        description=(
            "Search the company knowledge this assistant may read. Returns passages "
            "labelled [S<n>]; cite the labels of the passages you use."
        ),
        parameters=SEARCH_KNOWLEDGE_SCHEMA,
        effect="read",
        handler=handler,
    )
