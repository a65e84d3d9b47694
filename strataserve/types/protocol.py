"""Messages between the API process and an engine-core process (and the in-process core client).

msgspec structs: small, fast to encode, typed on decode. The request is sent once; outputs carry only what
changed since the last message (new token ids, finish reason, timings for metrics).
"""
from __future__ import annotations

import msgspec

from strataserve.types.outputs import TokenLogprobs  # noqa: F401  (re-exported for encoders)
from strataserve.types.sampling import SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0  # lower value = served first (vLLM convention)


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.. (sent with the first output)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (sent with the first output)
    # Wall-clock timestamps (time.time()) for metrics, each sent once when it happens.
    queued_time: float | None = None
    scheduled_time: float | None = None
    num_preemptions: int = 0


class SchedulerStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use (0..1)
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # tokens found (cumulative)
    num_preemptions: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative tokens prefilled (computed, not cached)
    generation_tokens: int = 0  # cumulative tokens sampled
    step_prefill_time: float = 0.0  # seconds spent in steps containing prefill (cumulative)
    step_decode_time: float = 0.0  # seconds spent in decode-only steps (cumulative)


class EngineCoreOutputs(msgspec.Struct, kw_only=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
