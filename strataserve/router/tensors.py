"""The router's face to the KServe v2 fronts (HTTP and gRPC): one model-server surface over the local model
repository and every upstream KServe server, dispatching by model name.

The fronts call the same methods they would call on a ``ModelServer``; the per-model ones are coroutines here
because an upstream answers over the network. The repository index lists every model the server fronts: the
repository's, the upstream ones (READY or UNAVAILABLE by health) and the text / speech models (READY, with a
reason naming the routes that serve them). An upstream model's infer takes the router's SLA class checks,
admission, tokens per minute (an LLM's text_input call) and per-class metrics, as ``/v1`` does
(``router/kserve_calls.py``). A local text model (command line or config) answers KServe too, as Triton's vLLM
backend does (``router/text_tensors.py``), and a repository LLM's calls take the same path
(``router/repo_llm.py``), also those an ensemble's step or a BLS call makes inside the model server; asking
KServe to infer on a speech model is a 400.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from strataserve.modelserver.generate import generate_request, generate_response
from strataserve.types.tensors import InferRequest, InferResponse, ModelServerError
from strataserve.router.backends.kserve_upstream import KServeUpstreamBackend
from strataserve.router.types import ModelCard, Payload

if TYPE_CHECKING:
    from strataserve.api.limits import RequestLimits
    from strataserve.router.repo_llm import RepositoryLLMs, RepositoryTextModel
    from strataserve.router.router import Router
    from strataserve.router.text_tensors import TextTensorModel

_ROUTES = {Payload.TEXT: "/v1/completions and /v1/chat/completions", Payload.SPEECH: "/v1/audio/speech"}
_KSERVE_TEXT = "; KServe generate, generate_stream and infer (text_input) too"


class TensorRouter:
    def __init__(self, local: Any | None, upstreams: dict[str, KServeUpstreamBackend],
                 other_models: Callable[[], list[ModelCard]] = list, *, router: Router | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.local = local  # strataserve.modelserver.server.ModelServer or None
        self.upstreams = upstreams
        self.other_models = other_models
        # The router whose local text backends answer KServe; ``router.non_tensor_cards`` (what the server passes
        # as ``other_models``) is bound to it, so it is found without a constructor change at every call site.
        self.router = router if router is not None else getattr(other_models, "__self__", None)
        self.limits = limits  # the OpenAI request limits (max_tokens, prompt tokens, stop strings) to apply
        self._text: dict[str, TextTensorModel] = {}
        self._repo_llms: RepositoryLLMs | None = None
        if local is not None and self.router is not None:
            # the repository's LLMs reached inside the model server (an ensemble's step, a BLS call) take the
            # direct call's class checks, admission, tokens per minute and --limit-max-tokens too
            local.route_llm_calls(self._llms())

    # ------------------------------------------------------------------ server level
    def live(self) -> bool:
        return self.local.live() if self.local is not None else True

    def ready(self) -> bool:
        """Triton's strict readiness: every model this process serves is ready, the text and speech engines
        included (a dead or restarting engine makes ``/v2/health/ready`` 503, as it makes ``/health``)."""
        if self.local is not None and not self.local.ready():
            return False
        return all(c.ready for c in self.other_models() if not c.backend.startswith("upstream"))

    def server_metadata(self) -> dict:
        if self.local is not None:
            return self.local.server_metadata()
        from strataserve.modelserver.lookup import server_metadata

        return server_metadata()

    # ------------------------------------------------------------------ dispatch
    def _upstream(self, name: str) -> KServeUpstreamBackend | None:
        return self.upstreams.get(name)

    def text_model(self, name: str) -> TextTensorModel | None:
        """The KServe face of local text model ``name`` (None: not one)."""
        backends = getattr(self.router, "backends", None)
        backend = backends.get(name) if backends else None
        if backend is None or backend.payload != Payload.TEXT or backend.upstream:
            return None
        model = self._text.get(name)
        if model is None or model.backend is not backend:
            from strataserve.router.text_tensors import TextTensorModel  # imports the API layer: not at load

            model = self._text[name] = TextTensorModel(self.router, backend, self.limits)
        return model

    def repository_llm(self, name: str, version: str = "") -> RepositoryTextModel | None:
        """The router's face of repository LLM ``name`` (None: not one, or no router to class its calls)."""
        if self.local is None or self.router is None:
            return None
        return self._llms().get(name, version)

    def _llms(self) -> RepositoryLLMs:
        if self._repo_llms is None:
            from strataserve.router.repo_llm import RepositoryLLMs  # imports the API layer: not at load

            most = self.limits.max_tokens if self.limits is not None else None  # --limit-max-tokens
            self._repo_llms = RepositoryLLMs(self.router, self.local, most)
        return self._repo_llms

    def _not_tensor(self, name: str) -> None:
        for card in self.other_models():
            if card.name == name:
                raise ModelServerError("invalid_argument", f"model '{name}' serves {card.payload.value}, not "
                                       f"tensors: use {_ROUTES.get(card.payload, 'its own routes')}")

    def _local(self, name: str) -> Any:
        if self.local is None:
            self._not_tensor(name)
            raise ModelServerError("not_found", f"unknown model '{name}'")
        return self.local

    def _check_local(self, name: str) -> Any:
        """The local server, after turning 'unknown model' into a clearer error for text / speech names."""
        ms = self._local(name)
        if name not in set(ms.repository.model_names() if ms.repository else ()) and not ms.model_ready(name):
            self._not_tensor(name)
        return ms

    async def model_ready(self, name: str, version: str = "") -> bool:
        up = self._upstream(name)
        if up is not None:
            return await up.model_ready(version)
        for card in self.other_models():
            if card.name == name:  # a text or speech model: ready while its engine serves
                return card.ready and version in ("", "1")
        return self.local is not None and self.local.model_ready(name, version)

    def is_decoupled(self, name: str, version: str = "") -> bool:
        if self._upstream(name) is not None:
            return False  # forwarded over plain HTTP infer: one response per request
        text = self.text_model(name)
        if text is not None:  # one response per infer (tritonclient's infer works); ``streams`` says the rest
            text.check_version(version)
            return False
        return self._check_local(name).is_decoupled(name, version)

    def streams(self, name: str, version: str = "") -> bool:
        """Whether a streaming call (ModelStreamInfer, SSE infer) should go through ``infer_stream`` although the
        model is not decoupled: a local text model, or a repository LLM, sends its text piece by piece there."""
        if self.text_model(name) is not None:
            return True
        if self._upstream(name) is not None or self.local is None:
            return False
        streams = getattr(self.local, "streams", None)
        return bool(streams is not None and streams(name, version))

    async def model_metadata(self, name: str, version: str = "") -> dict:
        up = self._upstream(name)
        if up is not None:
            return await up.model_metadata(version)
        text = self.text_model(name)
        if text is not None:
            return text.metadata(version)
        return self._check_local(name).model_metadata(name, version)

    async def model_config(self, name: str, version: str = "") -> dict:
        up = self._upstream(name)
        if up is not None:
            return await up.model_config(version)
        text = self.text_model(name)
        if text is not None:
            return text.config(version)
        return self._check_local(name).model_config(name, version)

    async def statistics(self, name: str = "", version: str = "") -> dict:
        if not name:
            stats = list(self.local.statistics()["model_stats"]) if self.local is not None else []
            for up in self.upstreams.values():
                if up.ready():
                    try:
                        stats.extend((await up.statistics())["model_stats"])
                    except ModelServerError:
                        pass  # one unreachable upstream must not hide the others' statistics
            for card in self.other_models():
                text = self.text_model(card.name)
                if text is not None:
                    stats.extend(text.statistics()["model_stats"])
            return {"model_stats": stats}
        up = self._upstream(name)
        if up is not None:
            return await up.statistics(version)
        text = self.text_model(name)
        if text is not None:
            return text.statistics(version)
        return self._check_local(name).statistics(name, version)

    async def repository_index(self, ready_only: bool = False) -> list[dict]:
        out = list(self.local.repository_index(ready_only)) if self.local is not None else []
        for name, up in sorted(self.upstreams.items()):
            ok = up.ready()
            if ok or not ready_only:
                out.append({"name": name, "version": "", "state": "READY" if ok else "UNAVAILABLE",
                            "reason": "upstream KServe server" if ok else up.replicas.unavailable_message()})
        for card in self.other_models():
            if card.ready or not ready_only:
                kserve = _KSERVE_TEXT if self.text_model(card.name) is not None else ""
                out.append({"name": card.name, "version": "", "state": "READY" if card.ready else "UNAVAILABLE",
                            "reason": f"{card.payload.value} model: served on {_ROUTES.get(card.payload, '')}"
                                      f"{kserve}"})
        return out

    async def load(self, name: str, parameters: dict | None = None) -> None:
        self._refuse_control(name, "load")
        await self._local(name).load(name, parameters)

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        self._refuse_control(name, "unload")
        await self._local(name).unload(name, unload_dependents=unload_dependents)

    def _refuse_control(self, name: str, verb: str) -> None:
        if name in self.upstreams:
            raise ModelServerError("invalid_argument", f"model '{name}' is served by an upstream KServe server: "
                                   f"{verb} it there")
        if self.text_model(name) is not None:
            raise ModelServerError("invalid_argument", f"model '{name}' is a text model served by its own engine "
                                   f"(command line or config), not from the model repository: it cannot be {verb}ed")
        if self.local is None or name not in set(self.local.repository.model_names() if self.local.repository
                                                 else ()):
            self._not_tensor(name)

    async def infer(self, request: InferRequest) -> InferResponse:
        up = self._upstream(request.model_name)
        if up is not None:
            if self.router is None:  # no router (a bare surface): nothing to check the class against or count
                return await up.infer(request)
            from strataserve.api.limits import RequestLimits  # the API layer: not imported at load
            from strataserve.router.kserve_calls import infer_upstream

            return await infer_upstream(self.router, up, request, self.limits or RequestLimits())
        text = self.text_model(request.model_name) or self.repository_llm(request.model_name,
                                                                          request.model_version)
        if text is not None:
            return await text.infer(request)
        return await self._check_local(request.model_name).infer(request)

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        text = self.text_model(request.model_name) or self.repository_llm(request.model_name,
                                                                          request.model_version)
        if text is not None:
            async for r in text.run(request, pieces=True):
                yield r
            return
        async for r in self._check_local(request.model_name).infer_stream(request):
            yield r

    def _no_generate(self, name: str) -> None:
        if name in self.upstreams:
            raise ModelServerError("invalid_argument", f"model '{name}' is served by an upstream KServe server; "
                                   "the generate extension is not forwarded: use infer")

    async def generate(self, name: str, version: str, inputs: dict, parameters: dict) -> dict:
        self._no_generate(name)
        text = self.text_model(name) or self.repository_llm(name, version)
        if text is not None:
            return generate_response(await text.infer(generate_request(text.spec, version, inputs, parameters)))
        return await self._check_local(name).generate(name, version, inputs, parameters)

    async def generate_stream(self, name: str, version: str, inputs: dict, parameters: dict) -> AsyncIterator[dict]:
        self._no_generate(name)
        text = self.text_model(name) or self.repository_llm(name, version)
        if text is not None:
            request = generate_request(text.spec, version, inputs, parameters)
            async for r in text.run(request, pieces=True):
                yield generate_response(r)
            return
        async for d in self._check_local(name).generate_stream(name, version, inputs, parameters):
            yield d
