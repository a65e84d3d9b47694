"""The FastAPI application: OpenAI routes, small utility routes, and (when the router fronts tensor models: a
local repository or upstream KServe servers) the KServe v2 routes of ``strataserve.api.kserve_http``. Every
route reaches its model through the router (``app.state.router``); none names an engine."""
from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strataserve.api import chat, completions, responses
from strataserve.api.console import mount_console
from strataserve.api.door import CORS, Door
from strataserve.api.errors import APIError, install_error_handlers
from strataserve.api.limits import RequestLimits
from strataserve.api.middleware import GuardMiddleware
from strataserve.api.protocol import DetokenizeRequest, TokenizeRequest
from strataserve.api.request_params import check_token_ids
from strataserve.api.serving import forward_plain, route
from strataserve.api.speech import make_speech_router
from strataserve.router.router import Router
from strataserve.router.types import Payload

CREATED = int(time.time())


def build_app(router: Router, *, registry: CollectorRegistry, door: Door | None = None,
              limits: RequestLimits | None = None, cors: CORS | None = None) -> FastAPI:
    """The HTTP front of everything ``router`` serves; ``registry`` backs ``/metrics``. The ``door`` holds the
    API keys (every route but the probes needs one when any is set), rate limits and drain state; ``limits``
    bounds what one OpenAI request may ask for."""
    app = FastAPI(title="strataserve", version="0.1.0",
                  description="OpenAI-compatible LLM serving and KServe v2 inference.")
    app.state.router = router
    app.state.limits = limits or RequestLimits()
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, door=door or Door())
    if cors is not None:  # added last, so outermost: preflights never reach the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
                           allow_headers=list(cors.headers), allow_credentials=cors.credentials)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    if router.of_kind(Payload.SPEECH):
        app.include_router(make_speech_router(lambda name: router.resolve(name, Payload.SPEECH).tts))

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 when every local engine is alive (an upstream being down is reported, not fatal: the other
        models keep serving); 503 with a JSON body naming each model's state otherwise (``degraded``: an engine
        is dead or restarting; the others serve). A model with replicas, some of them down, still serves: 200
        with ``{"status": "degraded", "models": ...}`` while its replacements start."""
        states = {b.name: b.status() for b in router.local_backends()}
        down = [name for name, st in states.items() if st not in ("serving", "degraded")]
        if down:
            err = APIError(503, f"the engine process of model(s) {', '.join(down)} is not running"
                           f"{' (restarting)' if 'restarting' in states.values() else ''}",
                           type="service_unavailable", code="engine_dead")
            return JSONResponse({"status": "degraded", "models": states, **err.body()}, status_code=503,
                                headers={"Retry-After": "5"})
        ms = router.tensors
        if ms is not None and not ms.live():
            return APIError(503, "model server is not live", type="service_unavailable").response()
        if "degraded" in states.values():
            return JSONResponse({"status": "degraded", "models": states})
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_entries() -> list[dict]:
        """Every model the server fronts; ``payload`` says which routes serve it (text: the OpenAI routes)."""
        data = []
        for card in router.cards():
            entry = {"id": card.name, "object": "model", "created": CREATED, "owned_by": "strataserve",
                     "root": card.name, "payload": card.payload.value, "backend": card.backend, "ready": card.ready}
            if card.max_model_len is not None:
                entry["max_model_len"] = card.max_model_len
            entry.update(card.extra)  # voices, languages; upstream name; replicas: each one's health, load, place
            data.append(entry)
            # --served-model-name NAME ALIAS...: one entry per name, as vLLM lists them (an AliasRouter's)
            for alias in getattr(router, "aliases_of", lambda _: [])(card.name):
                data.append({**entry, "id": alias})
        if router.tensors is not None and router.tensors.local is not None:
            for m in router.tensors.local.repository_index(ready_only=True):
                data.append({"id": m["name"], "object": "model", "created": CREATED, "owned_by": "strataserve",
                             "root": m["name"], "payload": "tensors", "backend": "repository", "ready": True})
        return data

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        return {"object": "list", "data": model_entries()}

    # ``path``: HF-style ids hold a slash ("Qwen/Qwen3-0.6B"); the openai client sends it unescaped
    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> dict:
        """OpenAI's ``client.models.retrieve(id)``: one entry of the listing, or 404 ``model_not_found``."""
        entries = model_entries()
        for entry in entries:
            if entry["id"] == model_id:
                return entry
        raise APIError(404, f"The model `{model_id}` does not exist; this server serves: "
                       f"{', '.join(e['id'] for e in entries) or 'no models'}.", param="model",
                       code="model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        routed = route(request, body.model)
        if routed.upstream:
            return await forward_plain(routed, request, "/tokenize")
        llm = routed.state
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = chat.render_chat(llm, body.messages, body.add_generation_prompt, body.tools,
                                   continue_final_message=body.continue_final_message,
                                   template_kwargs=body.chat_template_kwargs)
        elif llm.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer (--skip-tokenizer-init): it cannot tokenize "
                           "text", param="prompt")
        else:
            ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        # vLLM's shape: token_strs is always there, null unless asked for
        strs = llm.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        routed = route(request, body.model)
        if routed.upstream:
            return await forward_plain(routed, request, "/detokenize")
        llm = routed.state
        check_token_ids(llm, body.tokens, param="tokens")
        if llm.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer (--skip-tokenizer-init): it cannot "
                           "detokenize", param="tokens")
        return JSONResponse({"prompt": llm.tokenizer.decode(body.tokens)})

    if router.tensors is not None:
        from strataserve.api.kserve_http import make_kserve_router

        app.include_router(make_kserve_router(router.tensors))

    app.state.console = mount_console(app, router)

    @app.get("/version")
    async def version() -> JSONResponse:
        from importlib.metadata import PackageNotFoundError, version as pkg_version

        try:
            v = pkg_version("strataserve")
        except PackageNotFoundError:
            v = "0.1.0"
        return JSONResponse({"version": v})

    return app
