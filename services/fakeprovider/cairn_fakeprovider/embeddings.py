"""What vector does the fake give a text, and what does an embeddings request look like?

Vectors come from feature hashing over lower-cased words (blake2b, so they are the
same in every process, unlike `hash()`), then L2-normalised. A plain hash of the
whole text would also be deterministic, but then texts sharing words would be no
closer than unrelated ones; with word features a demo search still finds the
passage that shares the query's words.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Literal

from .chat_wire import token_estimate
from .errors import RequestRejected

DEFAULT_DIMENSIONS = 384
_MAX_DIMENSIONS = 4096
_WORD = re.compile(r"\w+")

EncodingFormat = Literal["float", "base64"]


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    inputs: tuple[str, ...]
    dimensions: int = DEFAULT_DIMENSIONS
    encoding_format: EncodingFormat = "float"


def parse_embeddings_request(body: object) -> EmbeddingsRequest:
    if not isinstance(body, dict):
        raise RequestRejected("The request body must be a JSON object.", code="invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestRejected(
            f"'model' must be a non-empty string, got {model!r:.80}.", param="model"
        )
    inputs = _parse_inputs(body.get("input"))
    dimensions = body.get("dimensions", DEFAULT_DIMENSIONS)
    if (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or not 1 <= dimensions <= _MAX_DIMENSIONS
    ):
        raise RequestRejected(
            f"'dimensions' must be an integer from 1 to {_MAX_DIMENSIONS}, got {dimensions!r:.80}.",
            param="dimensions",
        )
    encoding = body.get("encoding_format", "float")
    if encoding != "float" and encoding != "base64":
        raise RequestRejected(
            f"'encoding_format' must be 'float' or 'base64', got {encoding!r:.80}.",
            param="encoding_format",
        )
    return EmbeddingsRequest(
        model=model, inputs=inputs, dimensions=dimensions, encoding_format=encoding
    )


def _parse_inputs(raw: object) -> tuple[str, ...]:
    # The vendor also takes token arrays; we embed their decimal spelling, which is
    # just as deterministic.
    if isinstance(raw, str) and raw:
        return (raw,)
    if isinstance(raw, list) and raw:
        if all(isinstance(item, str) and item for item in raw):
            return tuple(raw)
        if all(isinstance(item, int) and not isinstance(item, bool) for item in raw):
            return (" ".join(str(token) for token in raw),)
        if all(
            isinstance(item, list)
            and item
            and all(isinstance(token, int) and not isinstance(token, bool) for token in item)
            for item in raw
        ):
            return tuple(" ".join(str(token) for token in item) for item in raw)
    raise RequestRejected(
        "'input' must be a non-empty string, a non-empty array of non-empty strings, "
        f"or token arrays, got {raw!r:.80}.",
        param="input",
    )


def _bucket_and_sign(feature: str, dimensions: int) -> tuple[int, float]:
    digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
    bucket = int.from_bytes(digest[:4], "little") % dimensions
    sign = 1.0 if digest[4] & 1 else -1.0
    return bucket, sign


def embed_text(text: str, *, dimensions: int = DEFAULT_DIMENSIONS) -> list[float]:
    vector = [0.0] * dimensions
    for feature in _WORD.findall(text.lower()) or [text]:
        bucket, sign = _bucket_and_sign(feature, dimensions)
        vector[bucket] += sign
    norm = math.sqrt(sum(value * value for value in vector))
    if norm == 0.0:
        # Opposite signs landed in one bucket and cancelled; fall back to the whole
        # text so the vector is still unit length.
        bucket, sign = _bucket_and_sign("\x00" + text, dimensions)
        vector = [0.0] * dimensions
        vector[bucket] = sign
        norm = 1.0
    return [value / norm for value in vector]


def render_embeddings(request: EmbeddingsRequest) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for index, text in enumerate(request.inputs):
        vector = embed_text(text, dimensions=request.dimensions)
        encoded: list[float] | str = vector
        if request.encoding_format == "base64":
            # Little-endian float32, which is what the OpenAI SDKs decode.
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(token_estimate(len(text)) for text in request.inputs)
    return {
        "object": "list",
        "data": data,
        "model": request.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
