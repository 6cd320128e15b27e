from __future__ import annotations

from cairn_gateway.app import GatewayApp
from cairn_libs.server import run_service

DEFAULT_PORT = 50051

if __name__ == "__main__":
    run_service(GatewayApp.from_env, default_port=DEFAULT_PORT)
