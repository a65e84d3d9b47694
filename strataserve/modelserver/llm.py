"""LLM models in the repository, served by the LLM engine (`AsyncLLM`): `text_input` BYTES in, `text_output` out.

A model folder is an LLM when its config says `backend: "llm"` or when it is a plain HF checkpoint folder
(config.json + *.safetensors, no config.pbtxt). The checkpoint is the version folder if it holds one, else the
model folder, else `parameters { key: "model" ... }`. Sampling settings come from the request parameters
(vLLM names: max_tokens, temperature, top_p, top_k, seed, stop, ...). `infer` answers with the whole text;
`stream` with one response per new piece of text (the generate_stream / decoupled path).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import fields
from pathlib import Path
from typing import AsyncIterator

import numpy as np

from strataserve.modelserver.autocomplete import TEXT_INPUT, TEXT_OUTPUT
from strataserve.modelserver.config import ConfigError, ModelSpec
from strataserve.modelserver.model import ModelVersion, ServedVersion
from strataserve.modelserver.repository import ModelSource, is_hf_folder
from strataserve.modelserver.stats import ModelStats
from strataserve.types.tensors import InferRequest, InferResponse, InferTensor, ModelServerError

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


def sampling_params(parameters: dict, model: str):
    from strataserve.types.sampling import RequestOutputKind, SamplingParams

    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(k for k in parameters if k not in known and k not in ("stream",))
    if unknown:
        raise ModelServerError("invalid_argument", f"model '{model}': unknown parameters {unknown}; sampling "
                               f"parameters use vLLM names such as max_tokens, temperature, top_p")
    try:
        given = {k: v for k, v in parameters.items() if k in known and k != "output_kind"}
        return SamplingParams(**given, output_kind=RequestOutputKind.DELTA)  # each response carries what is new
    except (TypeError, ValueError) as e:
        raise ModelServerError("invalid_argument", f"model '{model}': {e}") from None


class LLMVersion(ServedVersion):
    def __init__(self, spec: ModelSpec, version: int, stats: ModelStats, engine):
        self.spec, self.version, self.stats, self.engine = spec, version, stats, engine
        self._io = ModelVersion(spec, version, stats)  # request validation shared with other models

    @classmethod
    async def load(cls, source: ModelSource, version: int, stats: ModelStats) -> "LLMVersion":
        import asyncio

        from strataserve.config import EngineConfig, ModelConfig
        from strataserve.engine.async_llm import AsyncLLM

        path = _checkpoint(source, version)
        try:
            config = EngineConfig(ModelConfig(model=str(path), served_model_name=source.spec.name))
            engine = await asyncio.get_running_loop().run_in_executor(None, AsyncLLM.from_config, config)
        except (ValueError, OSError) as e:
            raise ModelServerError("invalid_argument", f"model '{source.spec.name}': cannot start the LLM engine on "
                                   f"{path}: {e}") from None
        return cls(source.spec, version, stats, engine)

    def _prompt(self, req: InferRequest) -> str:
        breq = self._io._validate(req)
        values = breq.inputs[TEXT_INPUT].reshape(-1)
        if values.size != 1:
            raise ModelServerError("invalid_argument", f"model '{self.spec.name}': '{TEXT_INPUT}' must hold one "
                                   f"prompt, got {values.size}")
        try:
            return values[0].decode("utf-8")
        except UnicodeDecodeError:
            raise ModelServerError("invalid_argument", f"model '{self.spec.name}': '{TEXT_INPUT}' is not UTF-8")

    def _response(self, req: InferRequest, text: str, extra: dict) -> InferResponse:
        arr = np.array([text.encode()], dtype=object)
        return InferResponse(self.spec.name, str(self.version), req.id,
                             [InferTensor(TEXT_OUTPUT, "BYTES", [1], arr)], parameters=extra)

    async def stream(self, req: InferRequest) -> AsyncIterator[InferResponse]:
        start, ok = time.monotonic_ns(), False
        self.stats.add_pending(1)
        try:
            prompt = self._prompt(req)
            params = sampling_params(req.parameters, self.spec.name)
            request_id = f"{self.spec.name}-{req.id or ''}-{next(_ids)}"
            t0 = time.perf_counter_ns()
            try:
                async for out in self.engine.generate(prompt, params, request_id):
                    c = out.outputs[0]
                    extra = {"finish_reason": c.finish_reason} if c.finish_reason else {}
                    if c.text or out.finished:
                        yield self._response(req, c.text, extra)
            except ValueError as e:
                raise ModelServerError("invalid_argument", f"model '{self.spec.name}': {e}") from None
            self.stats.execution_done(1, 1, 0, time.perf_counter_ns() - t0, 0)
            ok = True
        finally:
            self.stats.add_pending(-1)
            self.stats.request_done(ok, time.monotonic_ns() - start)

    async def infer(self, req: InferRequest) -> InferResponse:
        parts, extra = [], {}
        async for r in self.stream(req):
            parts.append(r.outputs[0].data[0].decode())
            extra = r.parameters
        return self._response(req, "".join(parts), extra)

    async def close(self) -> None:
        self.engine.shutdown()
