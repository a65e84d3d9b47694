"""ModelServer: the engine behind the KServe v2 fronts (repository, control modes, infer, stats).

Control modes (Triton's): "none" loads every model at start; "explicit" loads only `load_models` and then
what `load`/`unload` ask for; "poll" loads everything and a background task re-scans the repository every
`poll_interval_s` (new, changed and removed models and versions). A model that fails to load is listed as
UNAVAILABLE with the reason; every other model keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import AsyncIterator

import prometheus_client

from strataserve.modelserver.config import ModelSpec
from strataserve.modelserver.ensemble import EnsembleVersion, validate_ensemble
from strataserve.modelserver.generate import generate_request, generate_response
from strataserve.modelserver.llm import LLMVersion
from strataserve.modelserver.model import ModelVersion, ServedVersion
from strataserve.modelserver.repository import Repository
from strataserve.modelserver.stats import ModelStats, StatsCollector
from strataserve.types.tensors import InferRequest, InferResponse, ModelServerError

log = logging.getLogger(__name__)
CONTROL_MODES = ("none", "explicit", "poll")
EXTENSIONS = ["model_repository", "model_repository(unload_dependents)", "schedule_policy", "model_configuration",
              "binary_tensor_data", "parameters", "statistics", "generate"]


@dataclass
class _Entry:
    name: str
    spec: ModelSpec | None = None
    versions: dict[int, ServedVersion] = field(default_factory=dict)  # ready ones
    states: dict[str, tuple[str, str]] = field(default_factory=dict)  # version ("" = whole model) -> state, reason
    fingerprint: tuple | None = None


class ModelServer:
    def __init__(
        self,
        repository: str | os.PathLike | None,
        control_mode: str = "none",
        poll_interval_s: float = 1.0,
        registry: prometheus_client.CollectorRegistry | None = None,
        load_models: list[str] | None = None,
    ):
        if control_mode not in CONTROL_MODES:
            raise ValueError(f"model control mode {control_mode!r} is not one of {CONTROL_MODES}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {poll_interval_s}")
        self.repository = Repository(repository) if repository is not None else None
        self.control_mode = control_mode
        self.poll_interval_s = poll_interval_s
        self.load_models = list(load_models or [])
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._collector = StatsCollector(self._all_stats)
        self.registry.register(self._collector)
        self._entries: dict[str, _Entry] = {}
        self._lock: asyncio.Lock | None = None
        self._poller: asyncio.Task | None = None
        self._started = False
        self.loop: asyncio.AbstractEventLoop | None = None

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
                    await self._load_quietly(name)
            if self.control_mode == "poll":
                self._poller = asyncio.create_task(self._poll())
        self._started = True

    async def stop(self) -> None:
        self._started = False
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for entry in list(self._entries.values()):
            await self._close_versions(entry, "server stopped")
        try:
            self.registry.unregister(self._collector)
        except KeyError:
            pass

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self._started

    # -- loading -----------------------------------------------------------------------------------------------
    async def _load_quietly(self, name: str) -> None:
        try:
            await self._load_locked(name, None, set())
        except ModelServerError as e:
            log.warning("model %s failed to load: %s", name, e.message)

    async def _load_locked(self, name: str, override: str | None, loading: set[str]) -> None:
        repo = self._repo()
        repo.resolve(name)  # refuse bad names before they get an entry
        entry = self._entries.setdefault(name, _Entry(name))
        try:
            entry.fingerprint = repo.fingerprint(name)
            source = repo.load_source(name, override)
            spec = source.spec
            if spec.backend == "ensemble":
                loading = loading | {name}
                for step in spec.ensemble_steps:  # load what the ensemble needs (explicit mode), once
                    if step.model_name not in loading and not self._entries.get(step.model_name, _Entry("")).versions:
                        try:
                            await self._load_locked(step.model_name, None, loading)
                        except ModelServerError:
                            pass  # validate_ensemble names the step; the step model's entry keeps its reason
                validate_ensemble(spec, self._lookup_spec)
            if not source.versions:
                raise ModelServerError("invalid_argument", f"model '{name}' has no version folder (e.g. {name}/1/)")
        except ModelServerError as e:
            entry.states[""] = ("UNAVAILABLE", e.message)
            raise
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
        entry.spec, entry.versions, entry.states = spec, new, states
        for mv in old.values():
            await mv.close()
        if errors and not new:
            raise errors[0]

    async def _close_versions(self, entry: _Entry, reason: str) -> None:
        old, entry.versions = entry.versions, {}
        entry.states.pop("", None)
        for v in old:
            entry.states[str(v)] = ("UNAVAILABLE", reason)
        for mv in old.values():
            await mv.close()

    def _lookup_spec(self, name: str, version: int) -> ModelSpec | None:
        entry = self._entries.get(name)
        if entry is None or not entry.versions:
            return None
        if version >= 0 and version not in entry.versions:
            return None
        return entry.spec

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
        async with self._lock:
            await self._load_locked(name, override, set())

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        if self.control_mode != "explicit":
            raise ModelServerError("failed_precondition", f"cannot unload model '{name}': the model control mode "
                                   f"is '{self.control_mode}'; start the server with control mode 'explicit'")
        if name not in self._entries:
            self._repo().resolve(name)  # invalid names and unknown models get their own errors
        async with self._lock:
            await self._unload_locked(name, unload_dependents)

    async def _unload_locked(self, name: str, unload_dependents: bool) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        await self._close_versions(entry, "unloaded")
        if unload_dependents:
            for other in list(self._entries.values()):
                if other.spec and other.versions and name in {s.model_name for s in other.spec.ensemble_steps}:
                    await self._unload_locked(other.name, True)

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
                    await self._load_quietly(name)
            for name in sorted(set(self._entries) - names):
                await self._close_versions(self._entries.pop(name), "removed from the repository")

    # -- lookup ------------------------------------------------------------------------------------------------
    def _version(self, name: str, version: str = "") -> ServedVersion:
        entry = self._entries.get(name)
        if entry is None or not entry.versions:
            if entry is not None and entry.states:
                reasons = "; ".join(r for s, r in entry.states.values() if r)
                raise ModelServerError("unavailable", f"model '{name}' is not ready: {reasons or 'not loaded'}")
            raise ModelServerError("not_found", f"unknown model '{name}'")
        if not version:
            return entry.versions[max(entry.versions)]
        if not version.isdigit():
            raise ModelServerError("invalid_argument", f"model '{name}': version {version!r} is not a number")
        if int(version) not in entry.versions:
            raise ModelServerError("not_found", f"model '{name}' has no ready version {version} (ready versions: "
                                   f"{sorted(entry.versions)})")
        return entry.versions[int(version)]

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self._version(name, version)
            return True
        except ModelServerError:
            return False

    def is_decoupled(self, name: str, version: str = "") -> bool:
        return self._version(name, version).spec.decoupled

    def server_metadata(self) -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("strataserve")
        except PackageNotFoundError:
            v = "0.0.0"
        return {"name": "strataserve", "version": v, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str = "") -> dict:
        mv = self._version(name, version)
        versions = [str(v) for v in sorted(self._entries[name].versions)]
        return {"name": name, "versions": versions, "platform": mv.spec.platform or mv.spec.backend,
                **mv.metadata()}

    def model_config(self, name: str, version: str = "") -> dict:
        return self._version(name, version).config_json()

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        names = set(self.repository.model_names()) if self.repository else set()
        out = []
        for name in sorted(names | set(self._entries)):
            entry = self._entries.get(name)
            if entry is None or not entry.states:
                if not ready_only:
                    out.append({"name": name, "version": "", "state": "", "reason": ""})
                continue
            for version, (state, reason) in sorted(entry.states.items()):
                if not ready_only or state == "READY":
                    out.append({"name": name, "version": version, "state": state, "reason": reason})
        return out

    # -- inference ---------------------------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResponse:
        return await self._version(request.model_name, request.model_version).infer(request)

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        mv = self._version(request.model_name, request.model_version)
        async for response in mv.stream(request):
            yield response

    async def generate(self, name: str, version: str, inputs: dict, parameters: dict) -> dict:
        mv = self._version(name, version)
        response = await mv.infer(generate_request(mv.spec, mv.version, inputs, parameters))
        return generate_response(response)

    async def generate_stream(self, name: str, version: str, inputs: dict, parameters: dict) -> AsyncIterator[dict]:
        mv = self._version(name, version)
        async for response in mv.stream(generate_request(mv.spec, mv.version, inputs, parameters)):
            yield generate_response(response)

    # -- statistics --------------------------------------------------------------------------------------------
    def _all_stats(self) -> list[ModelStats]:
        return [mv.stats for e in list(self._entries.values()) for mv in list(e.versions.values())]

    def statistics(self, name: str = "", version: str = "") -> dict:
        if not name:
            if version:
                raise ModelServerError("invalid_argument", "a version needs a model name")
            return {"model_stats": [s.as_dict() for s in self._all_stats()]}
        if version:
            return {"model_stats": [self._version(name, version).stats.as_dict()]}
        self._version(name)
        return {"model_stats": [mv.stats.as_dict() for _, mv in sorted(self._entries[name].versions.items())]}


__all__ = ["ModelServer", "ModelServerError"]
