"""What a ModelServer serves now, read-only: the version a call reaches (or why none), readiness per model,
metadata, config, the repository index and statistics. ``ModelServer`` (``server.py``) inherits it; the entries
are that server's, changed only by its control calls under its lock."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as package_version

from strataserve.modelserver.entries import Entries
from strataserve.modelserver.llm import LLMVersion
from strataserve.modelserver.model import ServedVersion
from strataserve.modelserver.repository import Repository
from strataserve.modelserver.stats import ModelStats
from strataserve.types.tensors import ModelServerError

EXTENSIONS = ["model_repository", "model_repository(unload_dependents)", "schedule_policy", "model_configuration",
              "binary_tensor_data", "parameters", "statistics", "generate"]


def server_metadata() -> dict:
    """KServe's server metadata, the same for a model server and for a router with none of its own."""
    try:
        v = package_version("strataserve")
    except PackageNotFoundError:
        v = "0.0.0"
    return {"name": "strataserve", "version": v, "extensions": list(EXTENSIONS)}


class ServedModels:
    _entries: Entries
    repository: Repository | None

    # -- lookup ------------------------------------------------------------------------------------------------
    def _version(self, name: str, version: str = "") -> ServedVersion:
        entry = self._entries.get(name)
        if entry is None or not entry.versions:
            if entry is not None and entry.states:
                reasons = "; ".join(r for s, r in entry.states.values() if r)
                raise ModelServerError("unavailable", f"model '{name}' is not ready: {reasons or 'not loaded'}")
            raise ModelServerError("not_found", f"unknown model '{name}'")
        if entry.waiting:
            raise ModelServerError("unavailable", f"model '{name}' is not ready: {entry.waiting}")
        if not version:
            return entry.versions[max(entry.versions)]
        if not version.isdigit():
            raise ModelServerError("invalid_argument", f"model '{name}': version {version!r} is not a number")
        if int(version) not in entry.versions:
            raise ModelServerError("not_found", f"model '{name}' has no ready version {version} (ready versions: "
                                   f"{sorted(entry.versions)})")
        return entry.versions[int(version)]

    def llm_version(self, name: str, version: str = "") -> LLMVersion | None:
        """The LLM version that serves ``name`` now (``version``, or the latest ready one); None when the model is
        not an LLM or that version is not served (the model's own calls then answer with the reason)."""
        try:
            mv = self._version(name, version)
        except ModelServerError:
            return None
        return mv if isinstance(mv, LLMVersion) else None

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self._version(name, version)
            return True
        except ModelServerError:
            return False

    def is_decoupled(self, name: str, version: str = "") -> bool:
        return self._version(name, version).spec.decoupled

    def streams(self, name: str, version: str = "") -> bool:
        """Whether a streaming call (ModelStreamInfer, SSE infer) should get the model's answer in pieces although
        it is not decoupled: an LLM's text, as Triton's vLLM backend streams it."""
        return isinstance(self._version(name, version), LLMVersion)

    def server_metadata(self) -> dict:
        return server_metadata()

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
