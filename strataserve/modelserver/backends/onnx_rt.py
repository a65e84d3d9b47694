"""onnxruntime backend: one InferenceSession per instance (CUDA provider for KIND_GPU when available).

BYTES tensors are onnxruntime's tensor(string) (std::string), passed through byte for byte (onnx_strings.py).
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort

from strataserve.modelserver.backends.base import ArrayBackend, InstanceContext
from strataserve.modelserver.backends.onnx_strings import string_input, string_output, string_output_error
from strataserve.modelserver.config import ConfigError
from strataserve.modelserver.repository import model_file
from strataserve.types.tensors import ModelServerError


class OnnxBackend(ArrayBackend):
    def __init__(self, ctx: InstanceContext):
        super().__init__(ctx)
        bf16 = [t.name for t in (*ctx.spec.inputs, *ctx.spec.outputs) if t.datatype == "BF16"]
        if bf16:  # onnxruntime's Python API takes and returns no bfloat16 arrays
            raise ConfigError(ctx.spec.source, "data_type", f"{bf16}: the onnxruntime backend cannot pass BF16 "
                              "tensors; declare TYPE_FP16 or TYPE_FP32, or serve the model with the pytorch backend")
        path = model_file(ctx.spec, ctx.version_dir)
        opts = ort.SessionOptions()
        # Instances run in parallel threads; splitting the cores between them avoids oversubscription.
        threads = ctx.spec.parameters.get("intra_op_thread_count")
        opts.intra_op_num_threads = int(threads) if threads else max(1, (os.cpu_count() or 1) // ctx.spec.instance_count)
        opts.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if ctx.device.startswith("cuda"):
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise ModelServerError("unavailable", f"model '{ctx.spec.name}': instance kind GPU but onnxruntime "
                                       "has no CUDAExecutionProvider")
            providers = [("CUDAExecutionProvider", {"device_id": int(ctx.device.split(":")[1])}), "CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._strings = {i.name for i in self.session.get_inputs() if i.type == "tensor(string)"}
        self._string_outputs = {o.name for o in self.session.get_outputs() if o.type == "tensor(string)"}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {k: (string_input(self.spec.name, k, v) if k in self._strings else v) for k, v in inputs.items()}
        try:
            outs = self.session.run(self.output_names, feed)
        except UnicodeDecodeError as e:  # onnxruntime hands string outputs back only as UTF-8 text
            raise string_output_error(self.spec.name, sorted(self._string_outputs), feed, e) from None
        return {n: (string_output(o) if n in self._string_outputs else o) for n, o in zip(self.output_names, outs)}

    def close(self) -> None:
        self.session = None
