"""Python backend: a Triton-style `model.py` (class TritonPythonModel) run in-process.

In-process means tensors reach `execute()` as the very numpy arrays the server decoded (no shared-memory
copies, unlike Triton's stub process); `EXECUTION_ISOLATION: process` opts into a child process instead
(python_isolated.py). `execute(requests)` gets every request of a dynamic batch and returns
one response per request; a decoupled model answers through `request.get_response_sender()` instead. An
`async def execute` runs on the instance's own event loop (pb_runtime.InstanceLoop); model code runs with its
`ModelContext` bound (BLS, Logger, MetricFamily need it).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType


from strataserve.modelserver import pb_runtime, pb_utils
from strataserve.modelserver.backends.base import Backend, BackendRequest, InstanceContext, ModelOutputs
from strataserve.modelserver.pb_errors import error_from_triton
from strataserve.modelserver.config import ConfigError
from strataserve.modelserver.pbtxt import config_to_json
from strataserve.modelserver.repository import model_file
from strataserve.types.tensors import ModelServerError

ISOLATION_KEY = "EXECUTION_ISOLATION"
_module_ids = itertools.count()


def _load_module(path, model_name: str) -> ModuleType:
    # Triton models import the helper module by this name; ours is the in-process implementation.
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    name = f"_strata_pymodel_{model_name}_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = str(Path(path).parent)
    sys.path.insert(0, folder)  # as in Triton, model.py may import modules that sit beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def load_model_class(path: Path) -> type:
    """Import model.py and return its TritonPythonModel class (errors name the file)."""
    try:
        module = _load_module(path, path.parent.parent.name)
    except Exception as e:  # noqa: BLE001 - any error in user code is a load failure of this model
        raise ModelServerError("invalid_argument", f"{path}: import failed: {type(e).__name__}: {e}") from e
    cls = getattr(module, "TritonPythonModel", None)
    if cls is None:
        raise ModelServerError("invalid_argument", f"{path} defines no class TritonPythonModel")
    return cls


class PythonBackend(Backend):
    def __init__(self, ctx: InstanceContext):
        super().__init__(ctx)
        spec = ctx.spec
        isolation = spec.parameters.get(ISOLATION_KEY, "none")
        if isolation not in ("none", "process"):
            raise ConfigError(spec.source, f"parameters.{ISOLATION_KEY}",
                              f"'{isolation}' is not one of 'none' (in-process, the default) or 'process'")
        path = model_file(spec, ctx.version_dir)
        self.config_json = config_to_json(spec.proto)
        args = {
            "model_config": json.dumps(self.config_json),
            "model_instance_kind": "GPU" if ctx.device.startswith("cuda") else "CPU",
            "model_instance_name": f"{spec.name}_{ctx.instance_index}",
            "model_instance_device_id": ctx.device.split(":")[1] if ":" in ctx.device else "0",
            "model_repository": str(ctx.model_dir),
            "model_version": str(ctx.version),
            "model_name": spec.name,
        }
        self.context = pb_runtime.ModelContext(ctx.server, spec.name, model_version=str(ctx.version))
        self.loop: pb_runtime.InstanceLoop | None = None
        self.isolated = isolation == "process"
        if self.isolated:
            from strataserve.modelserver.backends.python_isolated import IsolatedModel

            self.model = IsolatedModel(path, args, spec.name,
                                       on_restart=ctx.stats.restarted if ctx.stats is not None else None)
            return
        self.loop = pb_runtime.InstanceLoop(self.context, args["model_instance_name"])
        try:
            with pb_runtime.bound(pb_runtime.ModelContext(ctx.server, spec.name, initializing=True,
                                                          model_version=str(ctx.version))):
                self.model = load_model_class(path)()
                if hasattr(self.model, "initialize"):
                    try:
                        self.model.initialize(args)
                    except (Exception, SystemExit) as e:  # noqa: BLE001 - user code
                        raise ModelServerError("invalid_argument",
                                               f"{path}: initialize() failed: {type(e).__name__}: {e}") from e
        except BaseException:
            self.loop.close()
            raise

    def prepare(self, requests: list[BackendRequest]) -> list[pb_utils.InferenceRequest]:
        out = []
        for r in requests:
            req = pb_utils.InferenceRequest(
                self.spec.name, [pb_utils.Tensor(k, v) for k, v in r.inputs.items()],
                r.requested_outputs or [t.name for t in self.spec.outputs], self.ctx.version,
                request_id=r.request_id or "", parameters=json.dumps(r.parameters, default=str),
            )
            req._cancel_check = lambda r=r: r.cancelled
            if self.spec.decoupled:
                req._sender = pb_utils.InferenceResponseSender(self._sender_fn(r), req._cancel_check)
            if self.isolated:  # the child process polls its own copy of the flag
                r.on_cancel = lambda req=req: self.model.cancel(req)
            out.append(req)
        return out

    def _sender_fn(self, r: BackendRequest):
        def send(response: pb_utils.InferenceResponse | None, final: bool) -> None:
            if response is None:
                r.send(None, None, final)
                return
            result = self._convert(response)
            if isinstance(result, BaseException):
                r.send(None, result, final)
            else:
                r.send(result, None, final)
        return send

    def infer(self, prepared: list[pb_utils.InferenceRequest]):
        if self.isolated:
            return self.model.execute(prepared)
        with pb_runtime.bound(self.context):
            return pb_runtime.run_execute(self.model, prepared, self.loop, self.spec.decoupled)

    def finish(self, result, requests: list[BackendRequest]):
        if self.spec.decoupled:
            return [None] * len(requests)
        if not isinstance(result, (list, tuple)) or len(result) != len(requests):
            got = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
            raise ModelServerError("internal", f"model '{self.spec.name}': execute() must return one response per "
                                   f"request ({len(requests)}), got {got}")
        return [self._convert(resp) for resp in result]

    def _convert(self, resp) -> ModelOutputs | BaseException:
        if not isinstance(resp, pb_utils.InferenceResponse):
            return ModelServerError("internal", f"model '{self.spec.name}': execute() returned a "
                                    f"{type(resp).__name__}, not an InferenceResponse")
        if resp.has_error():
            return error_from_triton(resp.error(), self.spec.name)
        params = json.loads(resp.parameters())
        return ModelOutputs({t.name(): t.as_numpy() for t in resp.output_tensors()}, params)

    def wait_ready(self) -> None:
        if self.isolated:
            self.model.wait_ready()

    def ready(self) -> bool:
        return not self.isolated or (self.model is not None and self.model.up)

    def on_timeout(self) -> bool:
        if not self.isolated:  # only an isolated model can be stopped mid-execution
            return False
        self.model.kill()
        return True

    def close(self) -> None:
        if self.loop is not None:
            self.loop.drain()
        try:
            if hasattr(self.model, "finalize"):
                with pb_runtime.bound(self.context):
                    self.model.finalize()
        finally:
            if self.loop is not None:
                self.loop.close()
            self.model = None
            custom = getattr(self.ctx.server, "custom_metrics", None)
            if custom is not None:  # its metric families end with it (Triton: with its stub process)
                custom.drop((self.spec.name, str(self.ctx.version)))
