"""One request's state inside the engine core (scheduler + KV cache manager view)."""
from __future__ import annotations

import enum
import time

from strataserve.types.protocol import EngineCoreRequest
from strataserve.types.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def check_prompt_length(n: int, max_model_len: int, max_pool_tokens: int) -> None:
    """Raise ValueError, saying what to change, for a prompt length the engine can never serve."""
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if n >= max_model_len:
        raise ValueError(f"the prompt has {n} tokens but this model's context (max_model_len) is {max_model_len}: "
                         f"shorten the prompt to at most {max_model_len - 1} tokens (or raise max_model_len)")
    if n > max_pool_tokens:
        raise ValueError(f"the prompt has {n} tokens but the whole KV cache holds {max_pool_tokens}: "
                         "shorten the prompt or give the KV cache more memory")


class Request:
    """Token ids, progress and limits of one sequence.

    ``all_token_ids`` = prompt + output, kept as one list so chunk slicing and block hashing never concatenate.
    ``num_computed_tokens`` counts tokens whose KV is in the cache (or scheduled to be written this step).
    ``max_len`` is where generation stops with "length": min(max_model_len, prompt + max_tokens, pool capacity + 1).
    ``block_hashes`` holds the chained hash of every full block of ``all_token_ids`` computed so far (lazily).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "all_token_ids", "sampling_params", "eos_token_id",
        "arrival_time", "priority", "status", "num_computed_tokens", "num_cached_tokens", "stop_reason",
        "block_hashes", "num_preemptions", "max_len", "min_len", "stop_token_ids", "seq", "first_scheduled_time",
        "queued_time", "_sent_first", "num_pending", "sync_only", "grammar", "prompt_logprobs",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_model_len: int,
        max_pool_tokens: int,
        seq: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = None if sampling_params.ignore_eos else eos_token_id
        self.arrival_time = time.time() if not arrival_time else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first admission; -1 until then
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        n = len(prompt_token_ids)
        limit = min(max_model_len, max_pool_tokens + 1)
        if sampling_params.max_tokens is not None:
            limit = min(limit, n + sampling_params.max_tokens)
        self.max_len = limit
        self.min_len = n + sampling_params.min_tokens
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.seq = seq  # admission tie-breaker: arrival order inside the core
        self.first_scheduled_time: float | None = None
        self.queued_time = time.time()
        self._sent_first = False
        #: sampling chunks scheduled whose token is not appended yet (async scheduling: the step in flight's)
        self.num_pending = 0
        #: sampling reads this request's past tokens on the host (penalties, min_tokens, seeds, logprobs), so
        #: the engine must know its last token before scheduling its next step
        #: the grammar matcher of a constrained request (``engine/structured_output.py``), set by the engine core
        self.grammar = None
        #: prompt logprobs gathered so far, for prompt positions 1, 2, ... (None: not asked)
        self.prompt_logprobs: list | None = [] if sampling_params.prompt_logprobs is not None else None
        # the runner's sampler reads a longer bad word's head from the host's output list, one token behind
        # while a step is in flight; everything else it needs travels with the step (runner/sampler.py)
        self.sync_only = (any(len(w) > 1 for w in sampling_params.bad_words_token_ids or ())
                          or self.prompt_logprobs is not None)

    @classmethod
    def from_core_request(cls, req: EngineCoreRequest, *, max_model_len: int, max_pool_tokens: int,
                          seq: int) -> "Request":
        return cls(req.request_id, list(req.prompt_token_ids), req.sampling_params, eos_token_id=req.eos_token_id,
                   arrival_time=req.arrival_time, priority=req.priority, max_model_len=max_model_len,
                   max_pool_tokens=max_pool_tokens, seq=seq)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_token(self, token_id: int) -> bool:
        """Add one sampled token; return True (and set status/stop_reason) if the request is now finished."""
        self.output_token_ids.append(token_id)
        all_ids = self.all_token_ids
        all_ids.append(token_id)
        n = len(all_ids)
        # min_tokens: the sampler bans stops, so never stop early here either; unless the grammar is complete and
        # allows nothing else (the sampler lets a stop through only then): structured outputs end with the grammar
        grammar = self.grammar
        if n >= self.min_len or grammar is not None:
            # a grammar's end is the output's end, ignore_eos or not: past it the output would run unconstrained
            if token_id == self.eos_token_id or (grammar is not None and token_id in grammar.stop_ids
                                                 and not grammar.failed):
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in self.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token_id
                return True
        if n >= self.max_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def add_prompt_logprobs(self, start: int, entries: list) -> None:
        """Entries for prompt tokens start + 1, ...; those already held (a recompute after preemption) are kept."""
        have = self.prompt_logprobs
        if have is not None and start <= len(have):
            have.extend(entries[len(have) - start:])

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, prio={self.priority})")
