"""ModelServer: the engine behind the KServe v2 fronts (repository, control modes, infer, stats)."""

from __future__ import annotations

import os
from typing import AsyncIterator

import prometheus_client

from strataserve.modelserver.types import InferRequest, InferResponse, ModelServerError


class ModelServer:
    def __init__(
        self,
        repository: str | os.PathLike | None,
        control_mode: str = "none",
        poll_interval_s: float = 1.0,
        registry: prometheus_client.CollectorRegistry | None = None,
        load_models: list[str] | None = None,
    ):
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    def live(self) -> bool:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def model_ready(self, name: str, version: str = "") -> bool:
        raise NotImplementedError

    def server_metadata(self) -> dict:
        raise NotImplementedError

    def model_metadata(self, name: str, version: str = "") -> dict:
        raise NotImplementedError

    def model_config(self, name: str, version: str = "") -> dict:
        raise NotImplementedError

    async def infer(self, request: InferRequest) -> InferResponse:
        raise NotImplementedError

    def infer_stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        raise NotImplementedError

    def is_decoupled(self, name: str, version: str = "") -> bool:
        raise NotImplementedError

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        raise NotImplementedError

    async def load(self, name: str, parameters: dict | None = None) -> None:
        raise NotImplementedError

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        raise NotImplementedError

    def statistics(self, name: str = "", version: str = "") -> dict:
        raise NotImplementedError

    async def generate(self, name: str, version: str, inputs: dict, parameters: dict) -> dict:
        raise NotImplementedError

    def generate_stream(self, name: str, version: str, inputs: dict, parameters: dict) -> AsyncIterator[dict]:
        raise NotImplementedError


__all__ = ["ModelServer", "ModelServerError"]
