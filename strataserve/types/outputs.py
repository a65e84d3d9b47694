"""Typed objects that cross layer boundaries inside one engine process.

Scheduler -> runner: ``SchedulerOutput``.  Runner -> scheduler: ``ModelRunnerOutput``.
Engine -> user (offline ``LLM`` and the async interface): ``RequestOutput`` with ``CompletionOutput``s, the same
names and fields as vLLM's so user code ports by changing an import.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strataserve.types.sampling import SamplingParams


# ----------------------------------------------------------------------------- scheduler -> runner
@dataclass(slots=True)
class NewRequestData:
    """Sent once when the runner first sees a request, and again when it resumes after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resumed after preemption (recompute)
    sampling_params: SamplingParams


@dataclass(slots=True)
class ScheduledChunk:
    """One request's work in one step: compute KV for ``token_ids`` at positions start_pos.. and maybe sample.

    ``block_table`` lists every KV block the request owns, in order; it covers positions [0, start_pos+len).
    Position p lives in block ``block_table[p // block_size]`` at offset ``p % block_size``.
    ``sample`` is True when the chunk ends at the last known token (last prefill chunk, or a decode step).
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    chunks: list[ScheduledChunk]
    # Requests the runner must forget (finished, aborted or preempted) before running this step.
    finished_req_ids: list[str]
    total_num_scheduled_tokens: int
    #: the grammar bitmask job of this step (``engine/structured_output.StructuredStep``) when a sampled request is
    #: constrained: ``structured.result()`` gives a ``GrammarBitmask`` to apply to the logits before sampling
    structured: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's logprob and rank (1 = most likely), plus the top-N alternatives (N may be 0)."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class ModelRunnerOutput:
    """One sampled token per chunk whose ``sample`` flag was set, in the order of ``SchedulerOutput.chunks``."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    #: request id -> (s, logprobs of prompt tokens s + 1, s + 2, ...) computed this step (prompt_logprobs)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None


# ----------------------------------------------------------------------------- engine -> user (vLLM names)
@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    #: vLLM's shape: None for the first prompt token, then {token id: Logprob} per prompt token (prompt_logprobs)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
