"""Test-only launcher: ModelServer + KServe HTTP router (uvicorn) + KServe gRPC front in one process/loop.

    python tests/kserve/_serve.py --repo DIR --http-port N --grpc-port M [--control-mode explicit --load '*']
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from fastapi import FastAPI

from strataserve.api.kserve_grpc import start_grpc_server
from strataserve.api.kserve_http import make_kserve_router
from strataserve.modelserver.server import ModelServer


async def serve(args: argparse.Namespace) -> None:
    ms = ModelServer(args.repo, control_mode=args.control_mode, load_models=args.load)
    await ms.start()
    app = FastAPI()
    app.include_router(make_kserve_router(ms))
    grpc_handle = await start_grpc_server(ms, "127.0.0.1", args.grpc_port)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.http_port, log_level="warning"))
    try:
        await server.serve()
    finally:
        await grpc_handle.stop(0.5)
        await ms.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--repo", required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--control-mode", default="none")
    p.add_argument("--load", action="append", default=[])
    asyncio.run(serve(p.parse_args()))
