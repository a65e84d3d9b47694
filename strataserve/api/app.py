"""The FastAPI application: OpenAI routes for the LLM, small utility routes, and (when a model repository is
served) the KServe v2 routes of ``strataserve.api.kserve_http``."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strataserve.api import chat, completions
from strataserve.api.errors import APIError, install_error_handlers
from strataserve.api.middleware import GuardMiddleware
from strataserve.api.protocol import DetokenizeRequest, TokenizeRequest
from strataserve.api.serving import ServerState, check_token_ids, llm_state

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def build_app(state: ServerState | None, *, registry: CollectorRegistry, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_server: Any = None, speech: Any = None) -> FastAPI:
    """``state`` is the LLM (None when only a model repository is served); ``registry`` backs ``/metrics``.
    ``speech``: an ``AsyncTTS``-like engine (``.name``) served at ``/v1/audio/speech`` (until the router lands)."""
    app = FastAPI(title="strataserve", version="0.1.0",
                  description="OpenAI-compatible LLM serving and KServe v2 inference.")
    app.state.strata = state
    app.state.model_server = model_server
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    app.include_router(completions.router)
    app.include_router(chat.router)
    if speech is not None:
        _mount_speech(app, speech, registry)

    @app.get("/health")
    async def health(request: Request) -> Response:
        llm: ServerState | None = request.app.state.strata
        if llm is not None:
            try:
                llm.check_alive()
            except APIError as exc:
                return exc.response()
        if speech is not None:
            try:
                speech.check_health()
            except Exception as exc:  # noqa: BLE001 - any failure of the TTS engine means not healthy
                return APIError(503, f"speech engine is not running: {exc}", type="service_unavailable").response()
        ms = request.app.state.model_server
        if ms is not None and not ms.live():
            return APIError(503, "model server is not live", type="service_unavailable").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        llm: ServerState | None = request.app.state.strata
        data = []
        if llm is not None:
            data.append({"id": llm.model_name, "object": "model", "created": llm.created, "owned_by": "strataserve",
                         "root": llm.model_name, "max_model_len": llm.max_model_len})
        if speech is not None:
            data.append({"id": speech.name, "object": "model", "owned_by": "strataserve", "root": speech.name,
                         "voices": list(speech.voices), "languages": list(speech.languages)})
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        llm = llm_state(request)
        llm.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = chat.render_chat(llm, body.messages, body.add_generation_prompt)
        else:
            ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        llm = llm_state(request)
        llm.check_model(body.model)
        check_token_ids(llm, body.tokens, param="tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    if model_server is not None:
        from strataserve.api.kserve_http import make_kserve_router

        app.include_router(make_kserve_router(model_server))

    @app.get("/version")
    async def version() -> JSONResponse:
        from importlib.metadata import PackageNotFoundError, version as pkg_version

        try:
            v = pkg_version("strataserve")
        except PackageNotFoundError:
            v = "0.1.0"
        return JSONResponse({"version": v})

    return app


def _mount_speech(app: FastAPI, speech: Any, registry: CollectorRegistry) -> None:
    """The speech route for one TTS engine, and its ``strata:tts_*`` metrics."""
    from strataserve.api.speech import make_speech_router
    from strataserve.api.tts_metrics import TTSMetrics

    def resolve(name: str | None) -> Any:
        if name in (None, "", speech.name):
            return speech
        raise APIError(404, f"model {name!r} is not served here; this server speaks with {speech.name!r}",
                       param="model", code="model_not_found")

    app.include_router(make_speech_router(resolve))
    TTSMetrics(speech, registry)
