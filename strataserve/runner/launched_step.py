"""``LaunchedStep``: the handle on one step the model runner has queued on the device.

Async scheduling keeps one step in flight while the next is scheduled; this holds what the engine needs from it
later: the sampled tokens (a device tensor, copied to pinned host memory behind an event), their logprobs, and
the event the engine times steps by.
"""
from __future__ import annotations

import threading

import torch

from strataserve.runner.sampler import DeferredLogprobs, SamplingRequest, resolve_logprobs
from strataserve.types.outputs import ModelRunnerOutput


class LaunchedStep:
    """One launched step: its sampled tokens (a device tensor until ``result``) and logprobs."""

    __slots__ = ("req_ids", "reqs", "tokens", "logprobs", "ids", "prompt_logprobs", "_host", "_event", "_out",
                 "_lock")

    def __init__(self, req_ids: list[str], reqs: list[SamplingRequest], tokens: torch.Tensor | None,
                 logprobs: list, ids: list[int] | None = None, prompt_logprobs: dict | None = None) -> None:
        self.req_ids, self.reqs, self.tokens, self.logprobs = req_ids, reqs, tokens, logprobs
        self.prompt_logprobs = prompt_logprobs
        self.ids = ids  # token ids already on the host (synchronous launch)
        self._host: torch.Tensor | None = None
        self._event = None
        self._out: ModelRunnerOutput | None = None
        # the grammar worker may read the tokens (async scheduling) before the engine loop does
        self._lock = threading.Lock()

    def copy_to_host(self) -> None:
        """Start the device -> pinned host copy of the tokens (CUDA), so ``result`` only waits for an event."""
        assert self.tokens is not None
        if not self.tokens.is_cuda:
            return  # ``result`` reads the tensor itself
        self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
        self._host.copy_(self.tokens, non_blocking=True)
        if isinstance(self.logprobs, DeferredLogprobs):
            self.logprobs.copy_to_host()
        self._event = torch.cuda.Event(enable_timing=True)  # the engine times steps between these (StepBudget)
        self._event.record()

    @property
    def done_event(self):
        """The CUDA event recorded after this step's work (None before ``copy_to_host`` or off CUDA)."""
        return self._event

    def result(self) -> ModelRunnerOutput:
        """Wait for the tokens and append each to its request's sampling state (penalties, seeds read it).
        Idempotent: later calls return the same output."""
        with self._lock:
            if self._out is None:
                self._out = self._result()
            return self._out

    def _result(self) -> ModelRunnerOutput:
        if self.ids is not None:
            ids = self.ids
        elif self._event is not None:
            self._event.synchronize()
            ids = self._host.tolist()  # type: ignore[union-attr]
        else:
            ids = self.tokens.tolist()  # type: ignore[union-attr]
        for req, tok in zip(self.reqs, ids):
            req.output_token_ids.append(tok)
        return ModelRunnerOutput(self.req_ids, ids, resolve_logprobs(self.logprobs), self.prompt_logprobs)
