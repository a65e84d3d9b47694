"""LLM models in the repository, served by the LLM engine (`AsyncLLM`): `text_input` BYTES in, `text_output` out.

A model folder is an LLM when its config says `backend: "llm"` or when it is a plain HF checkpoint folder
(config.json + *.safetensors, no config.pbtxt). The checkpoint is the version folder if it holds one, else the
model folder, else `parameters { key: "model" ... }`. Requests read and responses are shaped by `llm_io.py`
(Triton's vLLM-backend tensors, vLLM sampling names), shared with the router's text models. `infer` answers with
the whole text; `stream` with one response per new piece of text (the generate_stream / decoupled path).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Protocol

from strataserve.modelserver.config import ConfigError, ModelSpec
from strataserve.modelserver.llm_io import TextResponder, parse_text_request, sampling_params
from strataserve.modelserver.model import ModelVersion, ServedVersion
from strataserve.modelserver.repository import ModelSource, is_hf_folder
from strataserve.modelserver.stats import BACKEND, CANCELED, REJECTED, ModelStats
from strataserve.models.generation_defaults import sampling_defaults
from strataserve.types.tensors import InferRequest, InferResponse, ModelServerError

_ids = itertools.count()


def _checkpoint(source: ModelSource, version: int) -> Path:
    for candidate in (source.versions[version], source.model_dir):
        if is_hf_folder(candidate):
            return candidate
    explicit = source.spec.parameters.get("model")
    if explicit:
        return Path(explicit)
    raise ConfigError(source.spec.source, "parameters.model", f"no HF checkpoint (config.json + *.safetensors) in "
                      f"{source.versions[version]} or {source.model_dir}; set parameters {{ key: \"model\" }}")


class LLMCalls(Protocol):
    """Who serves the calls that reach an LLM version from inside the model server (an ensemble's step, a BLS
    call) when a router fronts it (``router/repo_llm.py``): the caller's class, admission, tokens per minute and
    ``--limit-max-tokens``, as for a direct call."""

    def infer(self, mv: "LLMVersion", req: InferRequest) -> Awaitable[InferResponse]: ...

    def stream(self, mv: "LLMVersion", req: InferRequest) -> AsyncIterator[InferResponse]: ...


class LLMVersion(ServedVersion):
    def __init__(self, spec: ModelSpec, version: int, stats: ModelStats, engine,
                 defaults: dict[str, Any] | None = None):
        self.spec, self.version, self.stats, self.engine = spec, version, stats, engine
        self.defaults = defaults or {}  # the checkpoint's generation_config.json, for the fields a request leaves
        self._io = ModelVersion(spec, version, stats)  # request validation shared with other models

    @classmethod
    async def load(cls, source: ModelSource, version: int, stats: ModelStats) -> "LLMVersion":
        from strataserve.config import EngineConfig, ModelConfig
        from strataserve.engine.async_llm import AsyncLLM

        path = _checkpoint(source, version)
        try:
            config = EngineConfig(ModelConfig(model=str(path), served_model_name=source.spec.name))
            engine = await asyncio.get_running_loop().run_in_executor(None, AsyncLLM.from_config, config)
        except (ValueError, OSError) as e:
            raise ModelServerError("invalid_argument", f"model '{source.spec.name}': cannot start the LLM engine on "
                                   f"{path}: {e}") from None
        # the checkpoint's recommended sampling (generation_config.json), as the command line's model applies it
        return cls(source.spec, version, stats, engine, sampling_defaults(path))

    async def _run(self, req: InferRequest, pieces: bool) -> AsyncIterator[InferResponse]:
        """The request's responses (llm_io.py reads it and shapes them, as for the router's text models)."""
        start, failure = time.monotonic_ns(), REJECTED  # (failure reasons: stats.py) until the request is read
        self.stats.add_pending(1)
        try:
            text = parse_text_request(self._io._validate(req).inputs, req.parameters, self.spec.name)
            params = sampling_params(text.parameters, self.spec.name, self.defaults)
            responder = TextResponder(self.spec, str(self.version), req, text,
                                      pieces and text.stream is not False)
            request_id = f"{self.spec.name}-{req.id or ''}-{next(_ids)}"
            t0 = time.perf_counter_ns()
            failure = BACKEND
            gen = self.engine.generate(text.prompt, params, request_id)
            try:
                async for out in gen:
                    response = responder.feed(out)
                    if response is not None:
                        failure = CANCELED  # a consumer that stops reading here went away
                        yield response
                        failure = BACKEND
            except ValueError as e:
                failure = REJECTED  # the engine refused the request (a 400: bad input)
                raise ModelServerError("invalid_argument", f"model '{self.spec.name}': {e}") from None
            finally:
                await gen.aclose()  # a consumer that left aborts the engine request now
            self.stats.execution_done(1, 1, 0, time.perf_counter_ns() - t0, 0)
            failure = None
        except (asyncio.CancelledError, GeneratorExit):
            failure = CANCELED
            raise
        finally:
            self.stats.add_pending(-1)
            self.stats.request_done(failure is None, time.monotonic_ns() - start, reason=failure or BACKEND)

    def stream(self, req: InferRequest) -> AsyncIterator[InferResponse]:
        """One response per new piece of text (one in all when the request says stream false)."""
        return self._run(req, pieces=True)

    async def infer(self, req: InferRequest) -> InferResponse:
        responses = [r async for r in self._run(req, pieces=False)]  # one: the whole text
        if not responses:  # the engine ends every request with a finished output; never expected
            raise ModelServerError("internal", f"model '{self.spec.name}': the engine sent no output")
        return responses[-1]

    async def close(self) -> None:
        self.engine.shutdown()
