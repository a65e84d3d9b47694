"""A local text model (``LocalLLMBackend``: one engine or replicas, from the command line or a config's
``models:``) on the KServe v2 fronts, as Triton's vLLM backend serves an LLM: ``generate`` / ``generate_stream``,
and ``infer`` / ``ModelStreamInfer`` with a BYTES ``text_input`` tensor.

The request is read and its responses shaped by ``modelserver/llm_io.py`` (the repository's LLM models use the
same code); the generation itself goes the way of ``/v1/completions``: the model's engine client, its admission
(TTFT 429s, the waiting-queue 503), the request's SLA class and API key (``KSERVE_CALLER``), the engine and
router metrics, and an abort in the engine when the consumer goes away (a closed stream, a cancelled call).
A repository LLM's calls take this path too (``router/repo_llm.py``), with ``--limit-max-tokens`` alone of the
request limits and its own output budget (``_hold_to_limits``, ``_budget``).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, AsyncIterator

from strataserve.api.errors import APIError
from strataserve.api.limits import RequestLimits
from strataserve.api.request_params import resolve_max_tokens, truncated
from strataserve.api.serving import Routed, engine_stream, local_state
from strataserve.modelserver.autocomplete import TEXT_INPUT
from strataserve.modelserver.llm_io import TextResponder, parse_text_request, sampling_params, text_model_spec
from strataserve.modelserver.model import ModelVersion, tensor_metadata
from strataserve.modelserver.pbtxt import config_to_json
from strataserve.modelserver.stats import BACKEND, CANCELED, REJECTED, ModelStats
from strataserve.router.kserve_calls import caller_routed, count_refusal, kserve_error, outcome
from strataserve.types.tensors import InferRequest, InferResponse, ModelServerError

if TYPE_CHECKING:
    from strataserve.router.backends.local_llm import LocalLLMBackend
    from strataserve.router.router import Router

VERSION = "1"
_ids = itertools.count()


class TextTensorModel:
    """The KServe face of one local text backend (version "1")."""

    def __init__(self, router: Router, backend: LocalLLMBackend, limits: RequestLimits | None = None) -> None:
        self.router, self.backend = router, backend
        self.limits = limits or RequestLimits()
        self.spec = text_model_spec(backend.name)
        self.stats = ModelStats(backend.name, VERSION)
        self.version = VERSION
        self._io = ModelVersion(self.spec, int(VERSION), self.stats)  # tensor checks shared with other models

    @property
    def name(self) -> str:
        return self.backend.name

    def check_version(self, version: str) -> None:
        if version not in ("", VERSION):
            raise ModelServerError("not_found", f"model '{self.name}' has no ready version {version} (ready "
                                   f"versions: [{VERSION}])")

    def metadata(self, version: str = "") -> dict:
        self.check_version(version)
        return {"name": self.name, "versions": [VERSION], "platform": "llm",
                "inputs": tensor_metadata(self.spec, self.spec.inputs),
                "outputs": tensor_metadata(self.spec, self.spec.outputs)}

    def config(self, version: str = "") -> dict:
        self.check_version(version)
        return config_to_json(self.spec.proto)

    def statistics(self, version: str = "") -> dict:
        self.check_version(version)
        return {"model_stats": [self.stats.as_dict()]}

    # ------------------------------------------------------------------ requests
    def _prepare(self, routed: Routed, req: InferRequest, pieces: bool) -> tuple[Any, list[int], Any, TextResponder]:
        """(engine state, prompt ids, SamplingParams, responder), every check of /v1/completions done."""
        state = local_state(routed)  # 503 when the engine process is gone
        text = parse_text_request(self._io._validate(req).inputs, req.parameters, self.name)
        params = sampling_params(text.parameters, self.name, state.sampling_defaults)
        self._hold_to_limits(params, text.parameters.get("max_tokens") is not None)
        if state.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer (--skip-tokenizer-init): it cannot take "
                           f"'{TEXT_INPUT}'", param=TEXT_INPUT)
        # vLLM's truncate_prompt_tokens, as /v1 applies it: the kept tokens are what is checked and counted
        ids = truncated(state, state.tokenizer.encode(text.prompt), params.truncate_prompt_tokens)
        params.truncate_prompt_tokens = None
        params.max_tokens = self._budget(state, len(ids), params.max_tokens)
        responder = TextResponder(self.spec, self.version, req, text, pieces and text.stream is not False)
        responder.prompt_tokens = len(ids)
        return state, ids, params, responder

    def _hold_to_limits(self, params: Any, given: bool) -> None:
        """The request limits of /v1 (``given``: the request set max_tokens; else its default is held to the
        limit)."""
        self.limits.check(SimpleNamespace(n=1, max_tokens=params.max_tokens if given else 0,
                                          stop=params.stop, logit_bias=params.logit_bias))
        if not given:
            params.max_tokens = self.limits.default_max_tokens(params.max_tokens)

    def _budget(self, state: Any, num_prompt: int, max_tokens: int | None) -> int:
        """The output budget, as /v1 resolves it (a 400 when the prompt and max_tokens pass the context)."""
        return resolve_max_tokens(state, num_prompt, max_tokens, "max_tokens", TEXT_INPUT)

    async def run(self, req: InferRequest, pieces: bool) -> AsyncIterator[InferResponse]:
        """The request's responses: one per new piece of text when ``pieces``, else one. Its statistics count a
        failure under Triton's reason as the repository's LLM counts it (``modelserver/llm.py``): REJECTED before
        the engine runs it (bad input, the class, the key's tokens, admission) or when the engine refuses it,
        CANCELED when the consumer goes away, BACKEND when the engine fails."""
        self.check_version(req.model_version)
        start, failure = time.monotonic_ns(), REJECTED
        self.stats.add_pending(1)
        routed: Routed | None = None
        try:
            routed = caller_routed(self.router, self.backend, self.limits)
            state, ids, params, responder = self._prepare(routed, req, pieces)
            work = float(len(ids))
            # 429 when the key's tokens per minute are spent or the queue ahead would miss the class's TTFT
            routed.check(work, work + params.max_tokens, 1, params.max_tokens)
            state.check_capacity(1)
            with state.hold(1):
                trace, ended = routed.trace(work), "aborted"  # unless it ends below: the consumer left
                rid = f"kserve-{self.name}-{req.id or ''}-{next(_ids)}"
                t0 = time.perf_counter_ns()
                failure = BACKEND
                try:
                    async with contextlib.aclosing(engine_stream(state, rid, ids, params, routed.priority(0),
                                                                 trace)) as outs:
                        async for out in outs:
                            response = responder.feed(out)
                            if response is not None:
                                failure = CANCELED  # a consumer that stops reading here went away
                                yield response
                                failure = BACKEND
                    ended = "ok"
                except (APIError, ModelServerError) as exc:
                    ended = outcome(exc)
                    failure = REJECTED if ended == "client_error" else BACKEND  # the engine refused it: bad input
                    raise
                finally:  # closing ``outs`` above aborted the engine request if we stopped early
                    trace.finish(ended)
            self.stats.execution_done(1, 1, 0, time.perf_counter_ns() - t0, 0)
            failure = None
        except BaseException as exc:
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                failure = CANCELED
            count_refusal(self.router, routed, exc)  # refused before its trace: counted as /v1 counts it
            if isinstance(exc, APIError):
                raise kserve_error(exc) from None
            raise
        finally:
            self.stats.add_pending(-1)
            self.stats.request_done(failure is None, time.monotonic_ns() - start, reason=failure or BACKEND)

    async def infer(self, req: InferRequest) -> InferResponse:
        last = None
        async with contextlib.aclosing(self.run(req, pieces=False)) as responses:
            async for last in responses:
                pass
        if last is None:  # the engine ends every request with a finished output; never expected
            raise ModelServerError("internal", f"model '{self.name}': the engine sent no output")
        return last
