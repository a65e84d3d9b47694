"""Shared test helpers: a started ModelServer over a repository built in tmp_path, driven with asyncio.run."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from strataserve.modelserver.server import ModelServer
from strataserve.types.tensors import InferRequest, InferTensor, ModelServerError


@contextlib.asynccontextmanager
async def serving(repo, **kwargs):
    server = ModelServer(repo, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def tensor(name: str, array: np.ndarray, datatype: str | None = None) -> InferTensor:
    from strataserve.types.tensors import kserve_dtype_of

    return InferTensor(name, datatype or kserve_dtype_of(array), list(array.shape), array)


def request(model: str, version: str = "", **inputs: np.ndarray) -> InferRequest:
    return InferRequest(model, version, inputs=[tensor(k, v) for k, v in inputs.items()])


def outputs(response) -> dict[str, np.ndarray]:
    return {t.name: t.data for t in response.outputs}


async def expect_error(code: str, coro, *fragments: str) -> ModelServerError:
    with pytest.raises(ModelServerError) as info:
        await coro
    assert info.value.code == code, info.value
    for f in fragments:
        assert f in info.value.message, (f, info.value.message)
    return info.value


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))
