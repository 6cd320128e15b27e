"""What retrieval asks of a Qdrant server when it creates the collection, and how
its server settings are read. No server runs here, so the client is a recorder
standing where AsyncQdrantClient would; the embedded engines ignore these settings."""

from __future__ import annotations

from typing import Any

import pytest

from cairn_retrieval.app import vector_store_from_env
from cairn_retrieval.errors import ConfigInvalid
from cairn_retrieval.vectors import QdrantVectorStore


class RecordingClient:
    def __init__(self) -> None:
        self.created: dict[str, Any] = {}

    async def collection_exists(self, name: str) -> bool:
        return False

    async def create_collection(self, name: str, **settings: Any) -> None:
        self.created = {"name": name, **settings}

    async def create_payload_index(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def get_collection(self, name: str) -> Any:
        raise ConnectionError("recorded; nothing to read")


async def test_a_server_collection_is_created_with_the_configured_replication_factor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QDRANT_URL", "http://qdrant.example:6333")
    monkeypatch.setenv("CAIRN_QDRANT_REPLICATION_FACTOR", "2")
    recorder = RecordingClient()
    store = vector_store_from_env(dimensions=384, qdrant_client=lambda **_: recorder)
    assert isinstance(store, QdrantVectorStore)
    await store.probe()
    assert recorder.created["replication_factor"] == 2


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_replication_factor_that_is_not_a_positive_number_stops_start_up(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("QDRANT_URL", "http://qdrant.example:6333")
    monkeypatch.setenv("CAIRN_QDRANT_REPLICATION_FACTOR", value)
    with pytest.raises(ConfigInvalid, match="CAIRN_QDRANT_REPLICATION_FACTOR"):
        vector_store_from_env(dimensions=384)
