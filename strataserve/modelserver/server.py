"""ModelServer: the engine behind the KServe v2 fronts (repository, control modes, infer, stats).

Control modes (Triton's): "none" loads every model at start; "explicit" loads only `load_models` and then
what `load`/`unload` ask for; "poll" loads everything and a background task re-scans the repository every
`poll_interval_s` (new, changed and removed models and versions). A model that fails to load is listed as
UNAVAILABLE with the reason; every other model keeps serving. With `strict_readiness` (Triton's
--strict-readiness, on by default) the server is ready only while every model it should serve is
(`Entries.not_ready`); off, it is ready once started.

Ensembles follow their steps: loading one loads the step models it needs (not "explicitly" loaded); while a
step model is not ready, or no longer fits the ensemble's config, the ensemble is UNAVAILABLE with the reason
(index, model ready, infer) and it is READY again once the step is (`Entries.refresh_ensembles`, after every control
call). `unload(ensemble, unload_dependents=True)` also unloads its steps that were not explicitly loaded and
that no other loaded ensemble uses (Triton's meaning). Unloading (or reloading) stops admitting at once and
returns; the old version finishes its queued and running requests in the background (listed UNLOADING
meanwhile), so other control calls never wait for a drain. `stop` waits for every drain. An explicit load
runs to its end even when its caller stops waiting (a gRPC deadline or cancel); only `stop` cancels one.
Read-only lookups (versions, metadata, index, statistics) are in ``lookup.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import AsyncIterator

import prometheus_client

from strataserve.modelserver.entries import Entries, Entry
from strataserve.modelserver.ensemble import EnsembleVersion, validate_ensemble
from strataserve.modelserver.generate import generate_request, generate_response
from strataserve.modelserver.llm import LLMCalls, LLMVersion
from strataserve.modelserver.lookup import ServedModels
from strataserve.modelserver.model import ErrorResponse, ModelVersion, ServedVersion
from strataserve.modelserver.pb_metrics import CustomMetrics
from strataserve.modelserver.repository import Repository
from strataserve.modelserver.stats import ModelStats, StatsCollector
from strataserve.types.tensors import InferRequest, InferResponse, ModelServerError

log = logging.getLogger(__name__)
CONTROL_MODES = ("none", "explicit", "poll")


class ModelServer(ServedModels):
    def __init__(
        self,
        repository: str | os.PathLike | None,
        control_mode: str = "none",
        poll_interval_s: float = 1.0,
        registry: prometheus_client.CollectorRegistry | None = None,
        load_models: list[str] | None = None,
        strict_readiness: bool = True,
    ):
        if control_mode not in CONTROL_MODES:
            raise ValueError(f"model control mode {control_mode!r} is not one of {CONTROL_MODES}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {poll_interval_s}")
        self.repository = Repository(repository) if repository is not None else None
        self.control_mode = control_mode
        self.poll_interval_s = poll_interval_s
        self.load_models = list(load_models or [])
        self.strict_readiness = strict_readiness
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._collector = StatsCollector(self._all_stats)
        self.registry.register(self._collector)
        self.custom_metrics = CustomMetrics()  # Python models' pb_utils.MetricFamily, on the same /metrics
        self.registry.register(self.custom_metrics)
        self._entries = Entries()
        self._lock: asyncio.Lock | None = None
        self._poller: asyncio.Task | None = None
        self._drains: set[asyncio.Task] = set()  # unloaded versions finishing their requests
        self._loads: set[asyncio.Task] = set()  # explicit loads, which outlive a caller that stops waiting
        self._started = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._llm_calls: LLMCalls | None = None  # the router's, when one fronts this server

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        if self.repository is not None:
            if self.control_mode == "explicit":
                names = self.repository.model_names() if "*" in self.load_models else self.load_models
            else:
                names = self.repository.model_names()
            async with self._lock:
                for name in names:
                    entry = self._entries.get(name)
                    if entry is None or not entry.versions:  # not already loaded as an ensemble's step
                        await self._load_quietly(name)
                    if name in self._entries:
                        self._entries[name].explicit = True
                self._entries.refresh_ensembles()
            if self.control_mode == "poll":
                self._poller = asyncio.create_task(self._poll())
        self._started = True

    async def stop(self) -> None:
        self._started = False
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for task in list(self._loads):
            task.cancel()
        await asyncio.gather(*list(self._loads), return_exceptions=True)
        for entry in list(self._entries.values()):
            self._close_versions(entry, "server stopped")
        while self._drains:  # shutdown waits for every in-flight request to finish
            await asyncio.gather(*list(self._drains), return_exceptions=True)
        for collector in (self._collector, self.custom_metrics):
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self._started and not (self.strict_readiness and self._entries.not_ready())

    # -- loading -----------------------------------------------------------------------------------------------
    async def _load_quietly(self, name: str) -> None:
        try:
            await self._load_locked(name, None, set())
        except ModelServerError as e:
            log.warning("model %s failed to load: %s", name, e.message)
        except Exception as e:  # noqa: BLE001 - one model's failure must not stop the server
            log.exception("model %s failed to load", name)
            self._entries.setdefault(name, Entry(name)).states[""] = ("UNAVAILABLE", f"{type(e).__name__}: {e}")

    async def _load_locked(self, name: str, override: str | None, loading: set[str]) -> None:
        repo = self._repo()
        repo.resolve(name)  # refuse bad names before they get an entry
        entry = self._entries.setdefault(name, Entry(name))
        try:
            entry.fingerprint = repo.fingerprint(name)
            source = repo.load_source(name, override)
            spec = source.spec
            entry.steps = tuple(dict.fromkeys(s.model_name for s in spec.ensemble_steps))
            if spec.backend == "ensemble":
                loading = loading | {name}
                for step in spec.ensemble_steps:  # load what the ensemble needs (explicit mode), once
                    if step.model_name not in loading and self._entries.lookup_spec(step.model_name, -1) is None:
                        try:
                            await self._load_locked(step.model_name, None, loading)
                        except ModelServerError:
                            pass  # validate_ensemble names the step; the step model's entry keeps its reason
                validate_ensemble(spec, self._entries.lookup_spec)
            if not source.versions:
                raise ModelServerError("invalid_argument", f"model '{name}' has no version folder (e.g. {name}/1/)")
        except Exception as e:  # noqa: BLE001 - model code runs here too (auto_complete_config): never fatal
            if not isinstance(e, ModelServerError):
                log.exception("model %s: loading its config failed", name)
                e = ModelServerError("invalid_argument", f"model '{name}' failed to load: {type(e).__name__}: {e}")
            entry.states[""] = ("UNAVAILABLE", e.message)
            raise e from None
        new: dict[int, ServedVersion] = {}
        states: dict[str, tuple[str, str]] = {}
        errors = []
        for v in source.versions:
            stats = ModelStats(name, str(v))
            try:
                if spec.backend == "ensemble":
                    new[v] = EnsembleVersion(spec, v, stats, self.infer)
                elif spec.backend == "llm":
                    new[v] = await LLMVersion.load(source, v, stats)
                else:
                    new[v] = await ModelVersion.load(source, v, stats, self)
                states[str(v)] = ("READY", "")
            except Exception as e:  # noqa: BLE001 - any failure of one version is reported, others still load
                msg = e.message if isinstance(e, ModelServerError) else f"{type(e).__name__}: {e}"
                states[str(v)] = ("UNAVAILABLE", msg)
                errors.append(e if isinstance(e, ModelServerError) else ModelServerError(
                    "invalid_argument", f"model '{name}' version {v} failed to load: {msg}"))
        old = entry.versions  # new requests go to the new versions at once; the old ones drain, then close
        entry.spec, entry.versions, entry.states, entry.waiting = spec, new, states, ""
        for v, mv in old.items():
            self._drain(entry, v, mv, None)
        if errors and not new:
            raise errors[0]

    def _close_versions(self, entry: Entry, reason: str) -> None:
        """Stop admitting now; each version finishes its requests in flight in the background, then closes."""
        old, entry.versions, entry.waiting = entry.versions, {}, ""
        entry.states.pop("", None)
        served = {str(v) for v in old}
        for key, (state, _) in list(entry.states.items()):
            # a version that failed to load is closed too: it takes this reason, so an unload releases strict
            # readiness (Triton's "unloaded"); one still draining keeps UNLOADING until its drain ends
            if key not in served and state != "UNLOADING":
                entry.states[key] = ("UNAVAILABLE", reason)
        for v, mv in old.items():
            if mv.stats.pending:
                state = ("UNLOADING", f"{reason}; finishing the requests in flight")
            else:
                state = ("UNAVAILABLE", reason)
            entry.states[str(v)] = state
            self._drain(entry, v, mv, state if state[0] == "UNLOADING" else None, reason)

    def _drain(self, entry: Entry, version: int, mv: ServedVersion, state: tuple | None, reason: str = "") -> None:
        mv.stop_admitting()

        async def drain() -> None:
            try:
                await mv.close()
            except Exception:  # noqa: BLE001 - a failing close must not break the server
                log.exception("model %s version %s: closing failed", entry.name, version)
            if state is not None and entry.states.get(str(version)) is state:  # not loaded again meanwhile
                entry.states[str(version)] = ("UNAVAILABLE", reason)

        task = asyncio.get_running_loop().create_task(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    def _repo(self) -> Repository:
        if self.repository is None:
            raise ModelServerError("failed_precondition", "the server has no model repository")
        return self.repository

    async def load(self, name: str, parameters: dict | None = None) -> None:
        if self.control_mode != "explicit":
            raise ModelServerError("failed_precondition", f"cannot load model '{name}': the model control mode is "
                                   f"'{self.control_mode}'; start the server with control mode 'explicit'")
        self._repo().resolve(name)
        parameters = dict(parameters or {})
        override = parameters.pop("config", None)
        files = [k for k in parameters if k.startswith("file:")]
        if files:
            raise ModelServerError("invalid_argument", f"load parameters {files}: file overrides are not supported")
        if override is not None and not isinstance(override, str):
            raise ModelServerError("invalid_argument", "load parameter 'config' must be a JSON string")
        # A caller that goes away (a gRPC deadline or cancel, a closed connection) stops waiting, not the load: it
        # runs to its end, so the model ends READY or UNAVAILABLE with its reason, never half loaded with an
        # initialize() still running unowned (Triton's load is not cancelled by its client either).
        task = asyncio.get_running_loop().create_task(self._load_explicit(name, override))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)
        task.add_done_callback(_retrieve)
        await asyncio.shield(task)

    async def _load_explicit(self, name: str, override: str | None) -> None:
        async with self._lock:
            entry = self._entries.setdefault(name, Entry(name))
            # strict readiness counts it from now (Entries._blocks), also when an unload left it "unloaded"; a
            # failed load then counts by its UNAVAILABLE state, until an unload or a load that succeeds
            entry.explicit = entry.loading = True
            try:
                await self._load_locked(name, override, set())
            except asyncio.CancelledError:  # only stop() cancels a load
                entry.states[""] = ("UNAVAILABLE", "the load was cancelled: the server stopped")
                raise
            finally:
                entry.loading = False
                self._entries.refresh_ensembles()

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        if self.control_mode != "explicit":
            raise ModelServerError("failed_precondition", f"cannot unload model '{name}': the model control mode "
                                   f"is '{self.control_mode}'; start the server with control mode 'explicit'")
        if name not in self._entries:
            self._repo().resolve(name)  # invalid names and unknown models get their own errors
        async with self._lock:
            self._unload_locked(name, unload_dependents)
            self._entries.refresh_ensembles()

    def _unload_locked(self, name: str, unload_dependents: bool) -> None:
        """Triton's unload_dependents: unloading an ensemble also unloads the step models that were loaded only
        for it (not explicitly) and that no other loaded ensemble uses, recursively. Ensembles that use an
        unloaded model are not unloaded: they wait, UNAVAILABLE, for it (`Entries.refresh_ensembles`)."""
        entry = self._entries.get(name)
        if entry is None:
            return
        steps = entry.steps  # of the config last loaded (or tried: its steps were loaded for it all the same)
        self._close_versions(entry, "unloaded")
        entry.explicit = False
        if unload_dependents:
            for step in steps:
                other = self._entries.get(step)
                if (other is not None and other.versions and not other.explicit
                        and not self._entries.used_by_an_ensemble(step)):
                    self._unload_locked(step, True)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self._poll_once()
            except Exception:  # noqa: BLE001 - a scan error must not stop polling
                log.exception("model repository poll failed")

    async def _poll_once(self) -> None:
        repo = self._repo()
        names = set(repo.model_names())
        async with self._lock:
            for name in sorted(names):
                entry = self._entries.get(name)
                if entry is None or entry.fingerprint != repo.fingerprint(name):
                    # marked before loading, as load() does: under strict readiness a model the poll has just
                    # found counts from now (Entries._blocks), not only once its load has ended
                    self._entries.setdefault(name, Entry(name)).explicit = True
                    await self._load_quietly(name)
            for name in sorted(set(self._entries) - names):
                self._close_versions(self._entries.pop(name), "removed from the repository")
            self._entries.refresh_ensembles()

    # -- inference ---------------------------------------------------------------------------------------------
    def route_llm_calls(self, calls: LLMCalls) -> None:
        """At start-up, by the router in front: the calls that reach an LLM version through this server (an
        ensemble's step, a BLS call; the router serves direct ones itself) go through ``calls``, so they are
        classed, admitted, charged and limited as the caller's own (``router/repo_llm.py``)."""
        self._llm_calls = calls

    async def infer(self, request: InferRequest) -> InferResponse:
        mv = self._version(request.model_name, request.model_version)
        if self._llm_calls is not None and isinstance(mv, LLMVersion):
            return await self._llm_calls.infer(mv, request)
        return await mv.infer(request)

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """Every response of the request; a decoupled model's error response that is not its last comes as an
        `ErrorResponse` item (Triton sends it and goes on), an error that ends the request is raised."""
        mv = self._version(request.model_name, request.model_version)
        calls = self._llm_calls if isinstance(mv, LLMVersion) else None
        async for response in (calls.stream(mv, request) if calls is not None else mv.stream(request)):
            yield response

    async def generate(self, name: str, version: str, inputs: dict, parameters: dict) -> dict:
        mv = self._version(name, version)
        response = await mv.infer(generate_request(mv.spec, mv.version, inputs, parameters))
        return generate_response(response)

    async def generate_stream(self, name: str, version: str, inputs: dict, parameters: dict) -> AsyncIterator[dict]:
        mv = self._version(name, version)
        async for response in mv.stream(generate_request(mv.spec, mv.version, inputs, parameters)):
            if isinstance(response, ErrorResponse):  # generate_stream has no per-response errors: it ends there
                raise response.error
            yield generate_response(response)


__all__ = ["ModelServer", "ModelServerError"]


def _retrieve(task: asyncio.Task) -> None:
    """A finished explicit load's error is its caller's to read, and nobody's once the caller has left."""
    if not task.cancelled():
        task.exception()  # marks it retrieved: no "exception was never retrieved" log for a caller that left
