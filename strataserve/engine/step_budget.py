"""How many prefill tokens a step may carry beside its decodes, so that decodes keep their pace.

A step's time is its decodes' time (weights and KV read once: memory bound, nearly flat in the number of decodes)
plus the prefill tokens it carries (compute bound: about linear in tokens). One 4,096-token prefill chunk in the
same step as 64 decodes makes that step ~15x a decode step long, and every running stream sees that gap as one
inter-token latency. So while decodes run, the scheduler gives prefill only what fits in ``target_ms``:

    prefill cap = (target - decode step time) / cost per prefill token,   clamped to [min_prefill, max_tokens - d]

Both estimates come from the last ``window`` observed steps: the decode step time is the median of decode-only
steps; the cost per prefill token, (step time - decode step time) / prefill tokens over steps with at least
``min_prefill // 2`` of them, is their lower quartile (the largest, most efficient recent steps). With no decodes
running a step may use every token of ``max_tokens`` (a lone prompt is as fast as it can be); before the first
prefill has been timed the cap is ``max_tokens`` too. ``min_prefill`` keeps prompts moving when the decodes alone
already take longer than the target (a large batch at long context).

Off by default (``target_step_ms=0``): the right target depends on the model, the device and the service level.
The linear model holds when a step's time is its device work, which mixed-step CUDA graphs (``runner/mixed_graph.py``)
made true in hybrid mode: before them an eager mixed step of the 8B shape cost ~16-36 ms of host time to launch
whatever its prefill size, smaller chunks were no faster and the cap drifted down round after round. With them
(run 9, 8B shape, Poisson 16 req/s of 1,024-token prompts, docs/performance.md): 28 ms keeps one prompt per step
(TTFT P50 41-47 ms, ITL P99 29.3-30.2 ms in 9 rounds); 26-27 ms splits each prompt (ITL P99 29.1-30.7 ms, TTFT
P50 43-56 ms).

Pure bookkeeping: the engine core times each step and calls ``observe``; the scheduler calls ``prefill_cap``.
"""
from __future__ import annotations

from collections import deque
from statistics import median

from strataserve.config import SchedulerConfig


class StepBudget:
    def __init__(self, target_ms: float, max_tokens: int, min_prefill: int = 256, window: int = 16) -> None:
        if not target_ms > 0:
            raise ValueError(f"target_ms={target_ms}: must be > 0 (leave the budget out to turn pacing off)")
        if max_tokens < 1 or min_prefill < 1 or window < 1:
            raise ValueError(f"max_tokens={max_tokens}, min_prefill={min_prefill}, window={window}: must be >= 1")
        self.target_s = target_ms / 1e3
        self.max_tokens = max_tokens
        self.min_prefill = min(min_prefill, max_tokens)
        self._decode_s: deque[float] = deque(maxlen=window)  # decode-only step times
        self._token_s: deque[float] = deque(maxlen=window)  # seconds per prefill token
        self._decode_med = 0.0
        self._token_est: float | None = None

    def prefill_cap(self, num_decodes: int) -> int:
        """Most prefill tokens a step with ``num_decodes`` decodes should carry."""
        room = self.max_tokens - num_decodes
        if num_decodes == 0 or self._token_est is None:
            return max(room, 0)
        if self._token_est <= 0.0:
            return max(room, 0)
        cap = int((self.target_s - self._decode_med) / self._token_est)
        return max(0, min(room, max(cap, self.min_prefill)))

    def observe(self, num_decodes: int, num_prefill: int, seconds: float) -> None:
        """Record one finished step: its decode count, prefill tokens and how long it kept the device."""
        if seconds <= 0.0:
            return
        if num_prefill == 0:
            if num_decodes:
                self._decode_s.append(seconds)
                self._decode_med = median(self._decode_s)
            return
        if num_prefill * 2 < self.min_prefill:
            return  # too few tokens: the step's fixed costs would swamp the per-token cost
        base = self._decode_med if num_decodes else 0.0
        self._token_s.append(max(seconds - base, 0.0) / num_prefill)
        self._token_est = sorted(self._token_s)[(len(self._token_s) - 1) // 4]

    @property
    def estimates(self) -> tuple[float, float | None]:
        """(decode step seconds, seconds per prefill token or None before the first timed prefill)."""
        return self._decode_med, self._token_est


def step_budget_for(config: SchedulerConfig) -> StepBudget | None:
    """The engine's budget: None (no pacing) unless ``config.target_step_ms`` is set."""
    target = config.target_step_ms
    return StepBudget(target, config.max_num_batched_tokens) if target > 0 else None
