"""Builders of small Triton-style model repositories for the model server and KServe tests.

Each `add_*` writes one model folder under `repo` and returns what a test needs to check outputs against
an independent computation (numpy / torch directly). Everything is tiny and CPU-only.

    repo = tmp_path / "repo"
    ref = add_onnx_mlp(repo)                  # "onnx_mlp": INPUT0 FP32 [-1,4] -> OUTPUT0 FP32 [-1,3]
    add_torchscript(repo)                     # "torch_affine": INPUT__0 FP32 [-1,3] -> OUTPUT__0 = relu(x)*2+1
                                              # (build_standard_repo adds "torch_affine_bf16": the same in BF16)
    add_torch_export(repo)                    # "torch_export" (.pt2; slow, not in build_standard_repo)
    add_python_scale(repo)                    # "py_scale": IN FP32 [-1,3] -> OUT = IN*3-1, BATCH INT32 = rows seen
    add_python_decoupled(repo)                # "py_decoupled": COUNT INT32 [1] -> COUNT responses OUT = 0..COUNT-1
    add_python_seq(repo)                      # "py_seq": SLEEP_MS FP32 [1] -> SEQ INT64 [1] (execution order)
    add_python_text(repo)                     # "py_text": text_input BYTES [1] -> text_output BYTES [1] (upper-cased)
    add_ensemble(repo)                        # "pipeline": onnx_mlp -> (torch_affine, py_scale) in parallel
"""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import numpy as np


def write_config(model_dir: Path, text: str) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.pbtxt"
    path.write_text(textwrap.dedent(text))
    return path


def mlp_weights(in_dim: int = 4, hidden: int = 8, out_dim: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "W1": rng.standard_normal((in_dim, hidden)).astype(np.float32),
        "b1": rng.standard_normal(hidden).astype(np.float32),
        "W2": rng.standard_normal((hidden, out_dim)).astype(np.float32),
        "b2": rng.standard_normal(out_dim).astype(np.float32),
    }


def mlp_reference(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """The MLP in plain numpy (independent of onnxruntime)."""
    return np.maximum(x @ w["W1"] + w["b1"], 0) @ w["W2"] + w["b2"]


def write_onnx_mlp(path: Path, w: dict[str, np.ndarray], input_name: str = "INPUT0", output_name: str = "OUTPUT0",
                   batch_dim: int | str = "batch") -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    in_dim, out_dim = w["W1"].shape[0], w["W2"].shape[1]
    nodes = [
        helper.make_node("MatMul", [input_name, "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "W2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], [output_name]),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [batch_dim, in_dim])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, [batch_dim, out_dim])],
        initializer=[numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # loadable by older onnxruntime releases too
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def add_onnx_mlp(repo: Path, name: str = "onnx_mlp", versions: tuple[int, ...] = (1,), config: str | None = "default",
                 max_batch_size: int = 8, max_queue_delay_us: int = 2000, instance_count: int = 1,
                 seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """An ONNX MLP per version (version v uses seed+v); returns {version: weights}. config=None: no config.pbtxt."""
    out = {}
    for v in versions:
        out[v] = mlp_weights(seed=seed + v)
        write_onnx_mlp(repo / name / str(v) / "model.onnx", out[v])
    if config == "default":
        write_config(repo / name, f"""
            name: "{name}"
            platform: "onnxruntime_onnx"
            max_batch_size: {max_batch_size}
            input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
            output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 3 ] }} ]
            instance_group [ {{ count: {instance_count} kind: KIND_CPU }} ]
            dynamic_batching {{ max_queue_delay_microseconds: {max_queue_delay_us} }}
        """)
    elif config is not None:
        write_config(repo / name, config)
    return out


def add_torchscript(repo: Path, name: str = "torch_affine", data_type: str = "TYPE_FP32"):
    """TorchScript module OUTPUT__0 = relu(INPUT__0) * 2 + 1 (tensors of ``data_type``); returns the torch module
    (the direct reference)."""
    import torch

    class Affine(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * 2.0 + 1.0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.script(Affine())
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    module.save(str(repo / name / "1" / "model.pt"))
    write_config(repo / name, f"""
        name: "{name}"
        backend: "pytorch"
        max_batch_size: 8
        input [ {{ name: "INPUT__0" data_type: {data_type} dims: [ 3 ] }} ]
        output [ {{ name: "OUTPUT__0" data_type: {data_type} dims: [ 3 ] }} ]
        dynamic_batching {{ }}
    """)
    return module


def add_torch_export(repo: Path, name: str = "torch_export"):
    """torch.export program `model.pt2`: (x, y) -> (x @ y.T, x.sum(-1, keepdim=True)); returns the nn.Module."""
    import torch

    class Two(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor):
            return x @ y.T, x.sum(-1, keepdim=True)

    module = Two()
    rows_x, rows_y = torch.export.Dim("rows_x", min=2, max=64), torch.export.Dim("rows_y", min=2, max=64)
    program = torch.export.export(module, (torch.ones(2, 3), torch.ones(3, 3)),
                                  dynamic_shapes=({0: rows_x}, {0: rows_y}))
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(repo / name / "1" / "model.pt2"))
    write_config(repo / name, f"""
        name: "{name}"
        backend: "pytorch"
        max_batch_size: 0
        input [ {{ name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] }},
                {{ name: "y" data_type: TYPE_FP32 dims: [ -1, 3 ] }} ]
        output [ {{ name: "xy" data_type: TYPE_FP32 dims: [ -1, -1 ] }},
                 {{ name: "xsum" data_type: TYPE_FP32 dims: [ -1, 1 ] }} ]
    """)
    return module


def write_python_model(repo: Path, name: str, code: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(code))
    write_config(repo / name, config)


PY_SCALE = """
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            config = json.loads(args["model_config"])
            out = pb_utils.get_output_config_by_name(config, "OUT")
            self.out_dtype = pb_utils.triton_string_to_numpy(out["data_type"])
            self.finalized = False

        def execute(self, requests):
            rows = sum(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().shape[0] for r in requests)
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                if not np.all(np.isfinite(x)):
                    responses.append(pb_utils.InferenceResponse(
                        error=pb_utils.TritonError("IN must be finite", pb_utils.TritonError.INVALID_ARG)))
                    continue
                out = pb_utils.Tensor("OUT", (x * 3 - 1).astype(self.out_dtype))
                batch = pb_utils.Tensor("BATCH", np.full((x.shape[0], 1), rows, dtype=np.int32))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out, batch]))
            return responses

        def finalize(self):
            self.finalized = True
"""


def add_python_scale(repo: Path, name: str = "py_scale", max_queue_delay_us: int = 2000,
                     preferred: tuple[int, ...] = ()) -> None:
    """OUT = IN*3-1 (error response for non-finite IN); BATCH = rows in the execution that served the request."""
    pref = f"preferred_batch_size: [ {', '.join(map(str, preferred))} ] " if preferred else ""
    write_python_model(repo, name, PY_SCALE, f"""
        name: "{name}"
        backend: "python"
        max_batch_size: 16
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 3 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] }},
                 {{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        dynamic_batching {{ {pref}max_queue_delay_microseconds: {max_queue_delay_us} }}
    """)


# a decoupled model that sends 0, an error response (not final), 2, then 3 with the final flag
PY_ERROR_MID_STREAM = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    def resp(i):
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))])


    class TritonPythonModel:
        def execute(self, requests):
            for r in requests:
                s = r.get_response_sender()
                s.send(resp(0))
                s.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("mid-stream error")))
                s.send(resp(2))
                s.send(resp(3), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

PY_DECOUPLED = """
    import threading
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.threads = []

        def execute(self, requests):
            for request in requests:
                count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
                sender = request.get_response_sender()
                # Respond from another thread, after execute() returned, as Triton's decoupled examples do.
                t = threading.Thread(target=self._respond, args=(sender, count))
                t.start()
                self.threads = [th for th in self.threads if th.is_alive()] + [t]  # finished ones are dropped
            return None

        def _respond(self, sender, count):
            if count < 0:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("COUNT must be >= 0")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            for i in range(count):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        def finalize(self):
            for t in self.threads:
                t.join()
"""


def add_python_decoupled(repo: Path, name: str = "py_decoupled") -> None:
    write_python_model(repo, name, PY_DECOUPLED, f"""
        name: "{name}"
        backend: "python"
        max_batch_size: 0
        input [ {{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        model_transaction_policy {{ decoupled: true }}
    """)


PY_SEQ = """
    import itertools
    import time
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.counter = itertools.count()

        def execute(self, requests):
            responses = []
            for request in requests:
                time.sleep(float(pb_utils.get_input_tensor_by_name(request, "SLEEP_MS").as_numpy().reshape(-1)[0]) / 1000)
                seq = np.array([[next(self.counter)]], dtype=np.int64)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEQ", seq)]))
            return responses
"""


def add_python_seq(repo: Path, name: str = "py_seq", max_queue_size: int = 0, default_timeout_us: int = 0,
                   timeout_action: str = "REJECT", priority_levels: int = 2, default_level: int | None = None,
                   level1_policy: str = "") -> None:
    """One instance, batches of one; SEQ = execution order. Priorities: 1 (high) .. priority_levels (the default
    level unless ``default_level``); ``level1_policy``: the queue policy fields of level 1 alone."""
    level1 = f"priority_queue_policy {{ key: 1 value: {{ {level1_policy} }} }}" if level1_policy else ""
    write_python_model(repo, name, PY_SEQ, f"""
        name: "{name}"
        backend: "python"
        max_batch_size: 1
        input [ {{ name: "SLEEP_MS" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "SEQ" data_type: TYPE_INT64 dims: [ 1 ] }} ]
        instance_group [ {{ count: 1 kind: KIND_CPU }} ]
        dynamic_batching {{
          priority_levels: {priority_levels}
          default_priority_level: {default_level or priority_levels}
          {level1}
          default_queue_policy {{
            max_queue_size: {max_queue_size}
            default_timeout_microseconds: {default_timeout_us}
            timeout_action: {timeout_action}
            allow_timeout_override: true
          }}
        }}
    """)


PY_TEXT = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
                out = np.array([t.decode().upper().encode() for t in text.reshape(-1)], dtype=object)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", out.reshape(text.shape))]))
            return responses
"""


def add_python_text(repo: Path, name: str = "py_text") -> None:
    write_python_model(repo, name, PY_TEXT, f"""
        name: "{name}"
        backend: "python"
        max_batch_size: 0
        input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
        output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
    """)


def add_ensemble(repo: Path, name: str = "pipeline") -> None:
    """X [-1,4] -> onnx_mlp -> H; H -> torch_affine -> A; H -> py_scale -> S (A and S run in parallel).
    Needs add_onnx_mlp, add_torchscript and add_python_scale in the same repo."""
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    write_config(repo / name, f"""
        name: "{name}"
        platform: "ensemble"
        max_batch_size: 8
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "A" data_type: TYPE_FP32 dims: [ 3 ] }},
                 {{ name: "S" data_type: TYPE_FP32 dims: [ 3 ] }} ]
        ensemble_scheduling {{
          step [
            {{ model_name: "onnx_mlp" model_version: -1
               input_map {{ key: "INPUT0" value: "X" }} output_map {{ key: "OUTPUT0" value: "H" }} }},
            {{ model_name: "torch_affine" model_version: -1
               input_map {{ key: "INPUT__0" value: "H" }} output_map {{ key: "OUTPUT__0" value: "A" }} }},
            {{ model_name: "py_scale" model_version: -1
               input_map {{ key: "IN" value: "H" }} output_map {{ key: "OUT" value: "S" }} }}
          ]
        }}
    """)


def build_standard_repo(repo: Path) -> dict:
    """Every model above in one repository; returns {"onnx_weights": {1: w}, "torch_module": m}."""
    weights = add_onnx_mlp(repo)
    module = add_torchscript(repo)
    add_torchscript(repo, "torch_affine_bf16", "TYPE_BF16")
    add_python_scale(repo)
    add_python_decoupled(repo)
    add_python_seq(repo)
    add_python_text(repo)
    add_ensemble(repo)
    return {"onnx_weights": weights, "torch_module": module}
