"""The engine <-> runner boundary: the engine core hands a ``SchedulerOutput`` in and gets a ``ModelRunnerOutput``.

Invariants: ``execute`` never allocates or frees KV blocks (the engine's block manager owns them); it writes KV
only into the slots named by each chunk's block table; it forgets a request's per-request state (sampling
state, penalty counters) when the request appears in ``finished_req_ids``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from strataserve.types.outputs import ModelRunnerOutput, SchedulerOutput


class ModelRunnerBase(ABC):
    #: tokens per KV block
    block_size: int
    #: KV blocks in the preallocated pool, fixed at construction from the memory budget
    num_blocks: int
    #: longest sequence (prompt + output) the runner accepts
    max_model_len: int

    @abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Chunks may mix prefill pieces and decode tokens."""

    def shutdown(self) -> None:
        """Release device memory and graphs. Safe to call twice."""
