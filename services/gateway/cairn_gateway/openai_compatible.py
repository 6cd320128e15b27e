"""OpenAI chat-completions over HTTP: the protocol every vendor the gateway uses
speaks, one provider per configured vendor, with its credentials, its base URL and
its connection pool.

The provider builds the request body from the domain request and its route, reads
the vendor's JSON (whole or as server-sent events) back into a Completion, and
turns every way an HTTP call can go wrong into an AttemptFailed with an Outcome, so
the failover loop sees neither JSON nor an aiohttp exception (see provider.py). The
codec itself is pure and lives in wire.py.

A provider owns one aiohttp session for its whole life (keep-alive to the vendor is
most of the latency a gateway can save) and closes it on stop. aiohttp rather than
httpx because the gateway's own overhead is what the benchmark holds it to, and
httpx costs several times as much CPU per request. The key lives only in the
session's Authorization header and in the redactor that scrubs it from any text a
vendor sends back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import aiohttp
from yarl import URL

from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import (
    Attempt,
    ChatRequest,
    Completion,
    ContentDelta,
    Outcome,
    Redactor,
    Route,
    error_for_attempt,
    estimate_prompt_tokens,
    outcome_for_status,
    reasoning_effort_for,
)
from cairn_gateway.errors import GatewayError, ProviderUnavailable
from cairn_gateway.provider import AttemptFailed
from cairn_gateway.wire import (
    DONE_SENTINEL,
    MalformedResponse,
    SseDecoder,
    StreamAssembler,
    chat_body,
    embeddings_body,
    error_text,
    error_text_from_body,
    loads_vendor_json,
    parse_completion,
    parse_embeddings,
    parse_retry_after,
)


class OpenAICompatibleProvider:
    def __init__(self, config: ProviderConfig, *, api_key: str, max_connections: int = 100) -> None:
        self.config = config
        headers = {"Accept": "application/json", **config.headers}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self._secrets = (api_key,) if api_key else ()
        self._max_connections = max_connections
        # Parsed once: a URL built per request is measurable at thousands a second.
        self._chat_url = URL(f"{config.base_url}/chat/completions")
        self._embeddings_url = URL(f"{config.base_url}/embeddings")
        # Made on first use, inside the event loop the gateway serves from.
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, limit_per_host=self._max_connections
                ),
                timeout=aiohttp.ClientTimeout(total=None),
                # Proxy and netrc settings of the environment must not reroute keys.
                trust_env=False,
                # One session serves every tenant: a vendor's cookies must not ride
                # along on another caller's request.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    def redactor(self) -> Redactor:
        return Redactor(secrets=self._secrets)

    def _body(self, request: ChatRequest, route: Route, *, stream: bool) -> dict[str, Any]:
        return chat_body(
            request,
            route,
            stream=stream,
            reasoning_effort=reasoning_effort_for(self.config, route.tier),
            max_tokens_field=self.config.max_tokens_field,
        )

    async def complete(
        self, request: ChatRequest, route: Route, *, timeout_seconds: float
    ) -> Completion:
        body = self._body(request, route, stream=False)
        redact = self.redactor().with_prompt(request.messages)
        # A unary call is bounded as a whole, not only per read: a vendor that
        # trickles bytes must not hold the caller past its timeout.
        timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        try:
            async with self._client().post(
                self._chat_url, json=body, timeout=timeout, allow_redirects=False
            ) as response:
                status = response.status
                content = await response.read()
                headers = response.headers
        except TimeoutError as exc:
            raise AttemptFailed(Outcome.TIMEOUT, f"no answer within {timeout_seconds:g}s") from exc
        except aiohttp.ClientPayloadError as exc:
            raise AttemptFailed(
                Outcome.STREAM_CUT,
                "the response body ended before it was complete",
                http_status=200,
            ) from exc
        except aiohttp.ClientError as exc:
            raise AttemptFailed(
                Outcome.CONNECTION_ERROR, self.redactor()(_transport_detail(exc))
            ) from exc
        if status != 200:
            raise self._status_failure(status, headers, content, redact)
        try:
            payload = loads_vendor_json(content)
        except ValueError as exc:
            raise AttemptFailed(
                Outcome.MALFORMED_RESPONSE, "the response body is not JSON", http_status=200
            ) from exc
        try:
            return parse_completion(payload, requested_model=route.model)
        except MalformedResponse as exc:
            raise AttemptFailed(
                Outcome.MALFORMED_RESPONSE, redact(str(exc)), http_status=200
            ) from exc

    async def stream(
        self, request: ChatRequest, route: Route, *, timeout_seconds: float
    ) -> AsyncGenerator[ContentDelta | Completion, None]:
        body = self._body(request, route, stream=True)
        redact = self.redactor().with_prompt(request.messages)
        assembler = StreamAssembler(requested_model=route.model)
        try:
            async with aclosing(
                self._chunks(body, redact=redact, timeout_seconds=timeout_seconds)
            ) as chunks:
                async for chunk in chunks:
                    try:
                        text = assembler.feed(chunk)
                    except MalformedResponse as exc:
                        raise AttemptFailed(
                            Outcome.MALFORMED_RESPONSE, redact(str(exc)), http_status=200
                        ) from exc
                    if text:
                        yield ContentDelta(text)
        except AttemptFailed as failure:
            # A finish_reason means the answer was whole; only the end marker
            # (and perhaps the usage chunk) was lost.
            if failure.outcome is not Outcome.STREAM_CUT or not assembler.finished:
                raise
        try:
            completion = assembler.completion(
                prompt_tokens_estimate=estimate_prompt_tokens(request.messages, request.tools)
            )
        except MalformedResponse as exc:
            raise AttemptFailed(
                Outcome.MALFORMED_RESPONSE, redact(str(exc)), http_status=200
            ) from exc
        yield completion

    async def _chunks(
        self, body: Mapping[str, Any], *, redact: Redactor, timeout_seconds: float
    ) -> AsyncGenerator[object, None]:
        """The decoded chunks of one streamed completion; ends at [DONE] or raises.
        `timeout_seconds` bounds connecting and each silence, not a long answer."""
        responded = False
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeout_seconds, sock_read=timeout_seconds
        )
        try:
            async with self._client().post(
                self._chat_url, json=body, timeout=timeout, allow_redirects=False
            ) as response:
                if response.status != 200:
                    content = await response.read()
                    raise self._status_failure(response.status, response.headers, content, redact)
                responded = True
                decoder = SseDecoder()
                async for raw_line in response.content:
                    data = decoder.feed(raw_line.decode("utf-8", "replace").rstrip("\r\n"))
                    if data is None:
                        continue
                    if data.strip() == DONE_SENTINEL:
                        return
                    try:
                        chunk = loads_vendor_json(data)
                    except ValueError as exc:
                        raise AttemptFailed(
                            Outcome.MALFORMED_RESPONSE,
                            "a stream event is not JSON",
                            http_status=200,
                        ) from exc
                    if isinstance(chunk, dict) and "error" in chunk:
                        raise AttemptFailed(
                            Outcome.SERVER_ERROR,
                            f"the stream carried an error: {redact(error_text(chunk))}",
                            http_status=200,
                        )
                    yield chunk
                raise AttemptFailed(
                    Outcome.STREAM_CUT, "the stream ended without [DONE]", http_status=200
                )
        except TimeoutError as exc:
            when = "between stream chunks" if responded else "before the stream began"
            raise AttemptFailed(
                Outcome.TIMEOUT,
                f"silent for {timeout_seconds:g}s {when}",
                http_status=200 if responded else 0,
            ) from exc
        except aiohttp.ClientError as exc:
            if responded:
                raise AttemptFailed(
                    Outcome.STREAM_CUT, self.redactor()(_transport_detail(exc)), http_status=200
                ) from exc
            raise AttemptFailed(
                Outcome.CONNECTION_ERROR, self.redactor()(_transport_detail(exc))
            ) from exc

    async def embed(self, texts: Sequence[str], *, model: str) -> list[list[float]]:
        """Vectors from the vendor's /embeddings; any failure is the caller's error,
        since vectors from another model could not be mixed with these."""
        redact = self.redactor()
        started = time.perf_counter()
        timeout = self.config.timeout_seconds
        try:
            try:
                async with self._client().post(
                    self._embeddings_url,
                    json=embeddings_body(texts, model),
                    timeout=aiohttp.ClientTimeout(total=timeout),
                    allow_redirects=False,
                ) as response:
                    status = response.status
                    content = await response.read()
                    headers = response.headers
            except TimeoutError as exc:
                raise AttemptFailed(Outcome.TIMEOUT, f"no answer within {timeout:g}s") from exc
            except aiohttp.ClientError as exc:
                raise AttemptFailed(
                    Outcome.CONNECTION_ERROR, self.redactor()(_transport_detail(exc))
                ) from exc
            if status != 200:
                raise self._status_failure(status, headers, content, redact)
            try:
                return parse_embeddings(loads_vendor_json(content), count=len(texts))
            except (ValueError, MalformedResponse) as exc:
                raise AttemptFailed(
                    Outcome.MALFORMED_RESPONSE, redact(str(exc)), http_status=200
                ) from exc
        except AttemptFailed as failure:
            raise self._embed_error(failure, model, time.perf_counter() - started) from failure

    def _embed_error(self, failure: AttemptFailed, model: str, latency: float) -> GatewayError:
        attempt = Attempt(
            provider=self.config.name,
            model=model,
            outcome=failure.outcome,
            http_status=failure.http_status,
            latency_seconds=latency,
            detail=failure.detail,
            retry_after_seconds=failure.retry_after_seconds,
        )
        error = error_for_attempt(attempt)
        if isinstance(error, ProviderUnavailable):
            return ProviderUnavailable(f"embedding with {error.message}")
        return error

    def _status_failure(
        self, status: int, headers: Mapping[str, str], content: bytes, redact: Redactor
    ) -> AttemptFailed:
        outcome = outcome_for_status(status)
        if status in (401, 403):
            # Vendors echo part of a rejected key in the message; say nothing of it.
            source = f" from {self.config.api_key_env}" if self.config.api_key_env else ""
            detail = f"HTTP {status}: the provider refused the key{source}"
        else:
            detail = f"HTTP {status}: {redact(error_text_from_body(content)) or 'no message'}"
        retry_after = parse_retry_after(headers) if status in (429, 503) else None
        return AttemptFailed(outcome, detail, http_status=status, retry_after_seconds=retry_after)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _transport_detail(exc: aiohttp.ClientError) -> str:
    # The exception's text can hold the host, never a header; still, keep it short.
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__
