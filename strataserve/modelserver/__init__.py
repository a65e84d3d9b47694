"""Layer 3': the multi-model server (Triton-like) behind the KServe v2 fronts.

    types.py        the typed boundary: InferTensor / InferRequest / InferResponse / ModelServerError
    server.py       ModelServer: control modes (none/explicit/poll), lookup, infer, stats, generate
    repository.py   model folders, safe name resolution, version folders + version policy
    config.py       config.pbtxt (model_config.proto) → validated ModelSpec; Triton's JSON form
    autocomplete.py fill a config from the model file (ONNX) / LLM text I/O
    model.py        one loaded version: request validation, response shaping
    batcher.py      the scheduler: priority queues, dynamic batching, queue policy, instance workers
    ensemble.py     DAG + step-model config validation, parallel execution of ensemble steps
    llm.py          LLM models served by the LLM engine (AsyncLLM)
    generate.py     KServe generate extension: JSON fields ↔ tensors
    stats.py        statistics extension + Prometheus collector (strata: metric names)
    pb_utils.py     `triton_python_backend_utils` for Python models
    backends/       onnxruntime, pytorch, python (+ python_isolated: opt-in child process)
"""
