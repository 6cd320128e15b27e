"""`python -m cairn_people_directory`: the demo people directory, serving its tools
over gRPC (a cairn.tools.v1.ToolService on CAIRN_PORT, default 50061) and MCP
(streamable HTTP on CAIRN_MCP_PORT, default 50062, path /mcp) from one process
and one PostgreSQL schema.

It is started like a cairn service but is not one: it stands for a company's own
system, so it verifies tokens itself (cairn_libs.identity) and shares nothing
with cairn but the contract in protos/cairn/tools/v1 and the public key.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import grpc
import structlog
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from cairn.tools.v1 import tools_pb2, tools_pb2_grpc
from cairn_libs.db import database_url
from cairn_libs.errors import ConfigurationError
from cairn_libs.telemetry import configure_logging, configure_tracing, shutdown_tracing
from cairn_people_directory.directory import Directory, database
from cairn_people_directory.door import Door
from cairn_people_directory.grpc_service import DirectoryToolService
from cairn_people_directory.mcp_service import directory_mcp

log = structlog.get_logger(__name__)

DEFAULT_GRPC_PORT = 50061
DEFAULT_MCP_PORT = 50062
SERVICE_NAME = tools_pb2.DESCRIPTOR.services_by_name["ToolService"].full_name


def _port(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default)).strip()
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigurationError(f"{name}={raw!r} is not a port; give a number from 1 to 65535")
    return int(raw)


async def serve() -> None:
    host = os.environ.get("CAIRN_HOST", "127.0.0.1")
    grpc_port = _port("CAIRN_PORT", DEFAULT_GRPC_PORT)
    mcp_port = _port("CAIRN_MCP_PORT", DEFAULT_MCP_PORT)
    door = Door.from_env()
    db = database(database_url())
    directory = Directory(db)

    server = grpc.aio.server()
    tools_pb2_grpc.add_ToolServiceServicer_to_server(DirectoryToolService(directory, door), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if server.add_insecure_port(f"{host}:{grpc_port}") == 0:
        raise ConfigurationError(f"could not listen on {host}:{grpc_port}; set CAIRN_PORT")

    mcp = directory_mcp(directory, door, public_url=f"http://{host}:{mcp_port}")
    http = uvicorn.Server(
        uvicorn.Config(
            mcp.streamable_http_app(stateless_http=True, json_response=True, host=host),
            host=host,
            port=mcp_port,
            log_level="warning",
            lifespan="on",
        )
    )
    await server.start()
    web = asyncio.create_task(http.serve())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("directory.listening", grpc=f"{host}:{grpc_port}", mcp=f"http://{host}:{mcp_port}/mcp")

    async def watch() -> None:
        last: bool | None = None
        while True:
            ok = http.started and await db.ready()
            if ok != last:
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if ok
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for name in ("", SERVICE_NAME):
                    await health.set(name, status)
                log.info("directory.health", serving=ok)
                last = ok
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    await asyncio.wait([asyncio.create_task(stop.wait()), web], return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    http.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await web
    await server.stop(grace=2)
    await db.close()


def main() -> None:
    configure_logging("people-directory")
    configure_tracing("people-directory")
    try:
        asyncio.run(serve())
    except ConfigurationError as exc:
        log.error("service.config_invalid", error=str(exc))
        shutdown_tracing()
        sys.exit(2)
    shutdown_tracing()


if __name__ == "__main__":
    main()
