"""How many prefill tokens a step may carry beside its decodes, so that decodes keep their pace.

A step's time is its decodes' time (weights and KV read once: memory bound, nearly flat in the number of decodes)
plus the prefill tokens it carries (compute bound: about linear in tokens). One 4,096-token prefill chunk in the
same step as 64 decodes makes that step ~15x a decode step long, and every running stream sees that gap as one
inter-token latency. So while decodes run, the scheduler gives prefill only what fits in ``target_ms``:

    prefill cap = (target - decode step time) / cost per prefill token,   clamped to [min_prefill, max_tokens - d]

Both estimates come from the last ``window`` observed steps: the decode step time is the median of decode-only
steps; the cost per prefill token, (step time - decode step time) / prefill tokens over steps with at least
``min_prefill // 2`` of them, is their median too. (It was their lower quartile, the most efficient recent steps,
while eager mixed steps cost the same whatever their size; with mixed-step graphs that estimate let steps run
~3 ms past the target: run 10, docs/performance.md.) With no decodes
running a step may use every token of ``max_tokens`` (a lone prompt is as fast as it can be); before the first
prefill has been timed the cap is ``max_tokens`` too. ``min_prefill`` keeps prompts moving when the decodes alone
already take longer than the target (a large batch at long context).

When it is on: the linear model holds when a step's time is its device work, which mixed-step CUDA graphs
(``runner/mixed_graph.py``) make true in hybrid mode. Before them an eager mixed step of the 8B shape cost ~16-36 ms
of host time to launch whatever its prefill size, smaller chunks were no faster and the cap drifted down round after
round. So ``target_step_ms=None`` (auto, `strata serve`'s default) paces at ``AUTO_TARGET_STEP_MS`` only where the
runner replays mixed-step graphs; the offline ``LLM`` defaults to 0 (off: throughput first, as vLLM's offline
defaults are). Run 10 (8B shape, H200, Poisson 16 req/s of 1,024-token prompts, docs/performance.md): 26, 27 and
28 ms all keep one prompt per step (ITL P99 27.1-29.1 ms, TTFT P50 38.7-45.6 ms); unpaced, steps holding two
prompts take ~51 ms and ITL P99 is ~48 ms.

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
        self._token_est = median(self._token_s)

    @property
    def estimates(self) -> tuple[float, float | None]:
        """(decode step seconds, seconds per prefill token or None before the first timed prefill)."""
        return self._decode_med, self._token_est


#: the target of ``target_step_ms=None`` (auto) where steps are timed by their device work: on the 8B shape on an
#: H200 it keeps one 1,024-token prompt per step beside the decodes (run 10: Poisson ITL P99 27.1-27.9 ms, TTFT
#: P50 39.5-42.7 ms; closed loop at concurrency 64 as fast as unpaced, with ITL P99 ~30 ms instead of ~100 ms)
AUTO_TARGET_STEP_MS = 27.0


def step_budget_for(config: SchedulerConfig, device_timed: bool = False) -> StepBudget | None:
    """The engine's budget: None (no pacing) unless ``config.target_step_ms`` is set; ``None`` (auto) paces at
    ``AUTO_TARGET_STEP_MS`` when ``device_timed`` (the runner replays mixed-step graphs, so a step's time is
    linear in its tokens) and not otherwise (eager or CPU steps: host-bound, the linear model does not hold)."""
    target = config.target_step_ms
    if target is None:
        target = AUTO_TARGET_STEP_MS if device_timed else 0.0
    return StepBudget(target, config.max_num_batched_tokens) if target > 0 else None
