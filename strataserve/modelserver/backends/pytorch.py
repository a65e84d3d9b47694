"""PyTorch backend: TorchScript `model.pt` (torch.jit.load) or torch.export `model.pt2` (torch.export.load).

Inputs bind to forward() and outputs to the returned tuple by Triton's naming conventions (torch_naming.py);
a model returning a dict gives its outputs by name.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from strataserve.modelserver.backends.base import ArrayBackend, InstanceContext
from strataserve.modelserver.backends.torch_naming import (
    BindingError,
    input_positions,
    output_positions,
    python_signature,
    torchscript_signature,
)
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
        # torch.export programs take their arguments positionally only (no keywords)
        self.signature = python_signature(self.module.forward) if path.suffix == ".pt2" else \
            torchscript_signature(self.module)
        self.keywords = path.suffix != ".pt2"
        self.dict_input = self.signature is not None and self.signature.dict_input
        self.input_names = [t.name for t in ctx.spec.inputs]
        self.output_names = [t.name for t in ctx.spec.outputs]
        try:
            in_pos = [] if self.dict_input else input_positions(self.input_names, self.signature)
            out_pos = output_positions(self.output_names)
        except BindingError as e:
            raise ConfigError(ctx.spec.source, "input/output names", str(e)) from None
        self.inputs_by_position = sorted(zip(in_pos, self.input_names))
        self.output_index = dict(zip(self.output_names, out_pos))

    def _call(self, inputs: dict[str, np.ndarray]):
        if self.dict_input:
            return self.module({n: _to_torch(a).to(self.device) for n, a in inputs.items()})
        args, kwargs = [], {}
        for pos, name in self.inputs_by_position:
            if name not in inputs:
                continue  # an optional input left out: forward()'s default applies
            tensor = _to_torch(inputs[name]).to(self.device)
            if pos == len(args) and not kwargs:
                args.append(tensor)
            elif self.keywords and self.signature is not None:
                kwargs[self.signature.names[pos]] = tensor  # after a gap, only a keyword reaches its parameter
            else:
                raise ModelServerError("invalid_argument", f"model '{self.spec.name}': input '{name}' goes to "
                                       f"forward() position {pos}, after an optional input the request left out; "
                                       "this model takes its arguments positionally, so send that input too")
        return self.module(*args, **kwargs)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            out = self._call(inputs)
        if isinstance(out, torch.Tensor):
            out = (out,)
        if isinstance(out, dict):
            missing = [n for n in self.output_names if n not in out]
            if missing:
                raise ModelServerError("internal", f"model '{self.spec.name}' returned no outputs {missing}")
            return {n: _to_numpy(out[n]) for n in self.output_names}
        bad = {n: i for n, i in self.output_index.items() if i >= len(out)}
        if bad:
            raise ModelServerError("internal", f"model '{self.spec.name}' returned {len(out)} tensors but the "
                                   f"config's outputs name positions {bad}")
        return {n: _to_numpy(out[i]) for n, i in self.output_index.items()}

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
