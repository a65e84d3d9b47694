"""A repository LLM (a bare HF folder or ``backend: "llm"``, ``modelserver/llm.py`` ``LLMVersion``) called through
the router's KServe surface: its requests take the path of the command line's text models
(``router/text_tensors.py``): the caller's SLA class (403 above the key's), admission (the class's TTFT 429, the
waiting-queue 503), the key's tokens per minute (prompt + max_tokens), the class's priority in the engine, and
the per-class metrics, under the model's name.

``--limit-max-tokens`` holds its calls as it holds every other LLM's: a max_tokens above the limit is a 400 (gRPC
INVALID_ARGUMENT); an unset one is the default the model would use (its checkpoint's generation_config, else 16)
held to the limit, and a null one (the rest of the context) the limit. What stays the repository's own: the other
``--limit-*`` request limits (prompt tokens, stop strings, logit_bias) do not apply, a budget past the context is
clipped as its engine clips it rather than refused, and its KServe statistics are the version's. The router's
state for a version (admission, in-flight count) lives as long as the model server serves that version and never
keeps an unloaded version's engine alive.

Calls that reach the version from inside the model server take the same path (``RepositoryLLMs`` is the model
server's ``LLMCalls``): an ensemble's LLM step and a BLS call (``InferenceRequest.exec`` / ``async_exec``) of an
in-process Python model are classed, admitted, charged to the outer request's key and held to
``--limit-max-tokens`` as a direct call, and counted in the per-class metrics under the LLM's name; a refusal is
the outer request's error (an ensemble names its step; a 429 keeps its Retry-After). The caller travels as
``KSERVE_CALLER``: into an ensemble's step tasks with the request's context, and onto the thread that executes a
Python model's requests (``modelserver/batcher.py``: a Python model's dynamic batch holds one caller's requests).
What it cannot reach: a thread or process the model starts itself, where a BLS call is classed as a call
without key (the default class, the keyless tokens-per-minute bucket); an isolated Python model
(``EXECUTION_ISOLATION: process``) has no BLS at all.
"""
from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, AsyncIterator

from strataserve.api.limits import RequestLimits
from strataserve.api.metrics import ServerMetrics
from strataserve.api.request_params import resolve_max_tokens
from strataserve.api.serving import ServerState
from strataserve.modelserver.autocomplete import TEXT_INPUT
from strataserve.modelserver.llm import LLMVersion
from strataserve.router.admission import AdmissionController
from strataserve.router.text_tensors import TextTensorModel
from strataserve.router.types import Backend, ModelCard, Payload
from strataserve.types.errors import EngineDeadError
from strataserve.types.tensors import InferRequest, InferResponse, ModelServerError

if TYPE_CHECKING:
    from strataserve.modelserver.server import ModelServer
    from strataserve.router.router import Router


class RepositoryLLMBackend(Backend):
    """One served version's engine as the router's admission and metrics see it (not in the router's registry:
    the model server lists and loads it)."""

    payload = Payload.TENSORS

    def __init__(self, name: str, engine: Any, defaults: dict[str, Any]) -> None:
        super().__init__(name)
        sched = engine.config.scheduler
        max_len = int(engine.max_model_len)
        # engine_stream records engine metrics; a repository LLM exposes none on /metrics, so these stay unregistered
        metrics = ServerMetrics(name, max_len, lambda: getattr(engine, "stats", None), register=False)
        self.state = ServerState(engine=engine, tokenizer=engine.tokenizer, model_name=name, max_model_len=max_len,
                                 metrics=metrics, max_inflight_seqs=sched.max_num_seqs + sched.max_waiting_requests,
                                 max_running_seqs=sched.max_num_seqs, sampling_defaults=dict(defaults))
        self.admission = AdmissionController(name, sched.max_num_seqs)

    def ready(self) -> bool:
        try:
            self.state.engine.check_health()
        except EngineDeadError:
            return False
        return True

    def card(self) -> ModelCard:
        return ModelCard(self.name, Payload.TENSORS, "repository", self.ready())


class RepositoryTextModel(TextTensorModel):
    """The router's face of one repository LLM version. It holds the version's parts, never the version: the
    model server's reference alone decides how long the version (and its engine) lives."""

    def __init__(self, router: Router, mv: LLMVersion, max_tokens: int | None = None) -> None:
        self.router = router
        self.backend = RepositoryLLMBackend(mv.spec.name, mv.engine, mv.defaults)
        self.limits = RequestLimits(max_tokens=max_tokens)  # --limit-max-tokens alone (module doc)
        self.spec, self.stats, self._io = mv.spec, mv.stats, mv._io
        self.version = str(mv.version)

    def check_version(self, version: str) -> None:
        if version and not (version.isdigit() and int(version) == int(self.version)):  # the server picked it
            raise ModelServerError("not_found", f"model '{self.name}' has no ready version {version}")

    def _hold_to_limits(self, params: Any, given: bool) -> None:
        """--limit-max-tokens as the command line's models take it (the 400 above it; an unset budget is the
        model's default, a null one the rest of the context, each held to the limit); stop strings and
        logit_bias keep the repository's bounds, so they are not passed to the check."""
        self.limits.check(SimpleNamespace(n=1, max_tokens=params.max_tokens if given else 0, stop=None,
                                          logit_bias=None))
        if not given:
            params.max_tokens = self.limits.default_max_tokens(params.max_tokens)

    def _budget(self, state: Any, num_prompt: int, max_tokens: int | None) -> int:
        """The rest of the context bounds max_tokens (the engine's rule); an empty prompt, or one that leaves no
        room, is refused before the key is charged."""
        rest = state.max_model_len - num_prompt
        if num_prompt == 0 or rest < 1:
            return resolve_max_tokens(state, num_prompt, None, "max_tokens", TEXT_INPUT)  # raises the 400
        return rest if max_tokens is None else min(max_tokens, rest)


class RepositoryLLMs:
    """The faces of the repository's served LLM versions, one per version object while the model server serves
    it (a weak map: an unloaded or replaced version drops its face, and its engine with it)."""

    def __init__(self, router: Router, local: ModelServer, max_tokens: int | None = None) -> None:
        self.router, self.local = router, local
        self.max_tokens = max_tokens  # --limit-max-tokens
        self._faces: weakref.WeakKeyDictionary[LLMVersion, RepositoryTextModel] = weakref.WeakKeyDictionary()

    def get(self, name: str, version: str = "") -> RepositoryTextModel | None:
        """The face of LLM ``name`` at ``version`` (None: not an LLM of the repository, or not served now: the
        model server's own call then answers, with its reason)."""
        mv = self.local.llm_version(name, version)  # the model server's pick: latest ready, or the one asked
        return None if mv is None else self.face(mv)

    def face(self, mv: LLMVersion) -> RepositoryTextModel:
        face = self._faces.get(mv)
        if face is None:
            face = self._faces[mv] = RepositoryTextModel(self.router, mv, self.max_tokens)
        return face

    # the model server's LLMCalls: an ensemble's step or a BLS call that reached version ``mv``
    async def infer(self, mv: LLMVersion, req: InferRequest) -> InferResponse:
        return await self.face(mv).infer(req)

    def stream(self, mv: LLMVersion, req: InferRequest) -> AsyncIterator[InferResponse]:
        return self.face(mv).run(req, pieces=True)
