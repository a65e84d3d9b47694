"""Types that cross a layer boundary (API ↔ router ↔ engines ↔ runner), in one neutral place every layer imports.

sampling.py   SamplingParams, GuidedDecodingParams          outputs.py   RequestOutput, SchedulerOutput, ...
protocol.py   engine-core wire messages (msgspec)            tensors.py   KServe tensors, InferRequest/Response
speech.py     SpeechParams, TTSInputError, SpeechTiming      errors.py    EngineDeadError
model_config_pb2.py   the model-repository config schema (model_config.proto)
"""
