"""Start the fake provider: `python -m cairn_fakeprovider --port 0 [--name NAME]`.

Once the socket is bound, exactly one JSON line goes to stdout,
`{"event": "listening", "port": N, "name": NAME}`, which is what tests and the demo
wait on (an event, not a sleep). Everything else, logs included, goes to stderr so
that line is never buried. SIGTERM and SIGINT stop the server and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

import structlog
from aiohttp import web

from .server import ProviderSettings, build_app

# In-flight hangs and streams are a fake's business only; do not let them hold up exit.
_SHUTDOWN_TIMEOUT_SECONDS = 0.5


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cairn_fakeprovider",
        description="OpenAI-compatible offline demo model and scriptable vendor fake.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--name", default="fakeprovider", help="echoed in the listening line")
    parser.add_argument(
        "--require-key", default=None, help="refuse /v1 calls without 'Authorization: Bearer KEY'"
    )
    parser.add_argument(
        "--latency-ms", type=int, default=0, help="fixed delay added to every answer"
    )
    args = parser.parse_args(argv)
    if args.latency_ms < 0:
        parser.error(f"--latency-ms must be >= 0, got {args.latency_ms!r}")
    return args


def _configure_logging() -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


async def serve(*, host: str, port: int, settings: ProviderSettings) -> None:
    runner = web.AppRunner(
        build_app(settings),
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_SECONDS,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        sys.stdout.write(
            json.dumps({"event": "listening", "port": bound_port, "name": settings.name}) + "\n"
        )
        sys.stdout.flush()
        structlog.get_logger("cairn_fakeprovider").info(
            "listening", host=host, port=bound_port, name=settings.name
        )
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    _configure_logging()
    settings = ProviderSettings(
        name=args.name, require_key=args.require_key, latency_seconds=args.latency_ms / 1000
    )
    asyncio.run(serve(host=args.host, port=args.port, settings=settings))


if __name__ == "__main__":
    main()
