"""PyTorch backend: TorchScript `model.pt` (torch.jit.load) or torch.export `model.pt2` (torch.export.load).

Inputs are passed positionally in the config's input order; outputs are taken in the config's output order
from a tensor / tuple / list, or by name from a dict.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from strataserve.modelserver.backends.base import ArrayBackend, InstanceContext
from strataserve.modelserver.config import ConfigError
from strataserve.modelserver.repository import model_file
from strataserve.types.tensors import KSERVE_DTYPES, ModelServerError

BF16 = KSERVE_DTYPES["BF16"]


class TorchBackend(ArrayBackend):
    def __init__(self, ctx: InstanceContext):
        super().__init__(ctx)
        for t in ctx.spec.inputs + ctx.spec.outputs:
            if t.datatype == "BYTES":
                raise ConfigError(ctx.spec.source, "data_type", f"'{t.name}': the pytorch backend has no string tensors")
        path = model_file(ctx.spec, ctx.version_dir)
        self.device = torch.device(ctx.device)
        if path.suffix == ".pt2":
            self.module = torch.export.load(str(path)).module()
            self.module.to(self.device)
        else:
            with warnings.catch_warnings():  # TorchScript is deprecated upstream but is what Triton users have
                warnings.simplefilter("ignore", DeprecationWarning)
                self.module = torch.jit.load(str(path), map_location=self.device)
            self.module.eval()
        self.input_names = [t.name for t in ctx.spec.inputs]
        self.output_names = [t.name for t in ctx.spec.outputs]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [_to_torch(inputs[n]).to(self.device) for n in self.input_names if n in inputs]
        with torch.inference_mode():
            out = self.module(*args)
        if isinstance(out, torch.Tensor):
            out = (out,)
        if isinstance(out, dict):
            missing = [n for n in self.output_names if n not in out]
            if missing:
                raise ModelServerError("internal", f"model '{self.spec.name}' returned no outputs {missing}")
            return {n: _to_numpy(out[n]) for n in self.output_names}
        if len(out) != len(self.output_names):
            raise ModelServerError("internal", f"model '{self.spec.name}' returned {len(out)} tensors but the "
                                   f"config declares {len(self.output_names)} outputs {self.output_names}")
        return {n: _to_numpy(t) for n, t in zip(self.output_names, out)}

    def close(self) -> None:
        self.module = None


def _to_torch(array: np.ndarray) -> torch.Tensor:
    """numpy -> torch; bfloat16 (ml_dtypes') goes through its bits, which torch cannot take directly."""
    array = np.ascontiguousarray(array)
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BF16)
    return tensor.numpy()
