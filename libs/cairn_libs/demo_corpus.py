"""The bundled demo corpus (demo/handbook.yaml) as retrieval documents, for
`make run`, the cross-service tests and the benchmarks alike."""

from __future__ import annotations

from typing import Any

import yaml

from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs.stack import REPO_ROOT

HANDBOOK = REPO_ROOT / "demo" / "handbook.yaml"


def load_handbook() -> dict[str, Any]:
    corpus: dict[str, Any] = yaml.safe_load(HANDBOOK.read_text())
    return corpus


def handbook_documents(corpus: dict[str, Any]) -> list[retrieval_pb2.Document]:
    return [
        retrieval_pb2.Document(
            document_id=d["id"],
            source=corpus["source"],
            title=d["title"],
            text=d["text"],
            acl=retrieval_pb2.Acl(**d["acl"]),
        )
        for d in corpus["documents"]
    ]
