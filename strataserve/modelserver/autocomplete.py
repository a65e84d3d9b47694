"""Fill what a config leaves out from the model file itself (ONNX graphs carry names, types and shapes)."""

from __future__ import annotations

from pathlib import Path

from strataserve.types import model_config_pb2 as pb
from strataserve.modelserver.config import DEFAULT_MAX_BATCH_SIZE, ConfigError

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"  # Triton's names for LLM text I/O
_ONNX_TO_CONFIG = {
    1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 4: "TYPE_UINT16", 5: "TYPE_INT16", 6: "TYPE_INT32",
    7: "TYPE_INT64", 8: "TYPE_STRING", 9: "TYPE_BOOL", 10: "TYPE_FP16", 11: "TYPE_FP64", 12: "TYPE_UINT32",
    13: "TYPE_UINT64", 16: "TYPE_BF16",
}


def _onnx_ios(path: Path, source) -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - onnx raises several types for a corrupt file
        raise ConfigError(source, "default_model_filename", f"cannot read ONNX file {path}: {e}") from None
    initializers = {i.name for i in model.graph.initializer}

    def describe(values):
        out = []
        for v in values:
            if v.name in initializers:
                continue
            tt = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tt.shape.dim]
            out.append((v.name, _ONNX_TO_CONFIG.get(tt.elem_type, "TYPE_INVALID"), dims))
        return out

    return describe(model.graph.input), describe(model.graph.output)


def autocomplete_onnx(cfg: pb.ModelConfig, path: Path, source) -> None:
    """Complete `cfg` in place from the ONNX file; a config entry that contradicts the file is a ConfigError."""
    inputs, outputs = _onnx_ios(path, source)
    if not cfg.HasField("max_batch_size"):
        batchable = all(dims and dims[0] == -1 for _, _, dims in inputs + outputs)
        cfg.max_batch_size = DEFAULT_MAX_BATCH_SIZE if batchable else 0
        if batchable and not cfg.HasField("dynamic_batching"):
            cfg.dynamic_batching.SetInParent()
    strip = 1 if cfg.max_batch_size > 0 else 0
    for kind, model_ios, items in (("input", inputs, cfg.input), ("output", outputs, cfg.output)):
        by_name = {n: (t, d) for n, t, d in model_ios}
        if not items:
            for n, t, d in model_ios:
                items.add(name=n, data_type=pb.DataType.Value(t), dims=d[strip:])
            continue
        for i, item in enumerate(items):
            if item.name not in by_name:
                raise ConfigError(source, f"{kind}[{i}].name", f"'{item.name}' is not an {kind} of {path.name}; "
                                  f"its {kind}s are {sorted(by_name)}")
            t, d = by_name[item.name]
            if item.data_type == pb.TYPE_INVALID:
                item.data_type = pb.DataType.Value(t)
            elif pb.DataType.Name(item.data_type) != t:
                raise ConfigError(source, f"{kind}[{i}].data_type", f"{pb.DataType.Name(item.data_type)} for "
                                  f"'{item.name}' but {path.name} has {t}")
            if not item.dims and not item.HasField("reshape"):
                item.dims.extend(d[strip:])


# Triton's vLLM backend's optional inputs and extra outputs (name, type), after text_input / text_output
LLM_OPTIONAL_INPUTS = (("stream", pb.TYPE_BOOL), ("sampling_parameters", pb.TYPE_STRING),
                       ("exclude_input_in_output", pb.TYPE_BOOL), ("return_finish_reason", pb.TYPE_BOOL),
                       ("return_num_input_tokens", pb.TYPE_BOOL), ("return_num_output_tokens", pb.TYPE_BOOL))
LLM_EXTRA_OUTPUTS = (("finish_reason", pb.TYPE_STRING), ("num_input_tokens", pb.TYPE_UINT32),
                     ("num_output_tokens", pb.TYPE_UINT32))


def add_llm_io(cfg: pb.ModelConfig) -> None:
    """Triton's vLLM-backend tensors that ``cfg`` lacks (as its auto_complete_config adds them): text_input /
    text_output when it declares no input / output, and each optional input and extra output it leaves out."""
    if not cfg.input:
        cfg.input.add(name=TEXT_INPUT, data_type=pb.TYPE_STRING, dims=[1])
    have = {i.name for i in cfg.input}
    for name, dtype in LLM_OPTIONAL_INPUTS:
        if name not in have:
            cfg.input.add(name=name, data_type=dtype, dims=[1], optional=True)
    if not cfg.output:
        cfg.output.add(name=TEXT_OUTPUT, data_type=pb.TYPE_STRING, dims=[1])
    have = {o.name for o in cfg.output}
    for name, dtype in LLM_EXTRA_OUTPUTS:
        if name not in have:
            cfg.output.add(name=name, data_type=dtype, dims=[1])


def complete_llm_config(cfg: pb.ModelConfig, hf_folder_only: bool) -> None:
    """Give an LLM config Triton's text I/O where it declares none. Not decoupled (as the command line's text
    models): infer answers one response with the whole text, tritonclient's infer works; generate_stream sends
    pieces. ``hf_folder_only`` (a bare checkpoint folder) is kept for the callers; it no longer differs."""
    cfg.backend = "llm"
    add_llm_io(cfg)


def autocomplete_python(cfg: pb.ModelConfig, path: Path, source) -> None:
    """Run the model class's static `auto_complete_config` (Triton's Python-backend hook), if it has one. As in
    Triton, `as_dict()` is the whole config with every field (empty `input: []` / `output: []` included); any
    exception of the hook fails this model's load only, naming the file and the cause."""
    from google.protobuf import json_format

    from strataserve.modelserver import pb_utils
    from strataserve.modelserver.backends.python import load_model_class
    from strataserve.modelserver.pbtxt import config_to_json

    cls = load_model_class(path)
    hook = getattr(cls, "auto_complete_config", None)
    if hook is None:
        return
    config = config_to_json(cfg)
    try:
        result = hook(pb_utils.ModelConfig(config))
        completed = (result if result is not None else pb_utils.ModelConfig(config)).as_dict()
        cfg.Clear()
        json_format.ParseDict(completed, cfg)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - user code: anything it raises is this model's error
        raise ConfigError(source, "auto_complete_config", f"{path}: {type(e).__name__}: {e}") from None
