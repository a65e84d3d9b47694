"""The engine core loop: scheduler + model runner, one ``step()`` at a time.

Runs in-process (offline ``LLM``, ``InprocCoreClient``, tests) or inside the engine-core process of the server.
It deals only in token ids; tokenising, detokenising and stop strings live in the front end.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

from strataserve import envs
from strataserve.config import EngineConfig
from strataserve.types.outputs import SchedulerOutput
from strataserve.types.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from strataserve.engine.request import Request
from strataserve.engine.scheduler import Scheduler
from strataserve.engine.step_budget import step_budget_for
from strataserve.engine.structured_output import StructuredOutputManager, fill_threads_for
from strataserve.runner.base import ModelRunnerBase
from strataserve.runner.cpu_threads import CpuThreadGovernor


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunnerBase | None = None) -> None:
        if runner is None:
            from strataserve.runner.model_runner import ModelRunner

            runner = ModelRunner(config)  # type: ignore[assignment]
        self.config = config
        self.runner: ModelRunnerBase = runner  # type: ignore[assignment]
        self.block_size = runner.block_size  # type: ignore[union-attr]
        self.num_blocks = runner.num_blocks  # type: ignore[union-attr]
        self.max_model_len = runner.max_model_len  # type: ignore[union-attr]
        self.scheduler = Scheduler(config.scheduler, num_blocks=self.num_blocks, block_size=self.block_size,
                                   max_model_len=self.max_model_len,
                                   enable_prefix_caching=config.cache.enable_prefix_caching,
                                   step_budget=step_budget_for(config.scheduler,
                                                               bool(getattr(runner, "mixed_step_graphs", False))))
        # Async scheduling (runners that can ``launch`` a step and report ``supports_async``, i.e. CUDA): step N+1
        # is scheduled and queued while step N runs on the device, and step N's tokens are applied after that,
        # so the host work of a step overlaps the device work of the previous one.
        mcfg = getattr(runner, "model_config", None)
        self.structured = StructuredOutputManager(
            config.model.tokenizer or config.model.model, getattr(mcfg, "vocab_size", 0),
            getattr(runner, "eos_token_ids", ()), fill_threads_for(getattr(runner, "device", "cpu")))
        self._async = bool(getattr(runner, "supports_async", False)) and hasattr(runner, "launch")
        #: CPU engines on the work-sharing pool (``runner/cpu_pool.py``): torch is held at one thread while stepping
        self.cpu_pool = getattr(runner, "cpu_pool", None)
        #: CPU engines on torch's threads: their count follows the cores other processes leave free (None elsewhere;
        #: the pool needs no governor: its caller never waits for a thread that is off its core)
        self.thread_governor = (CpuThreadGovernor.for_device(getattr(runner, "device", None))
                                if self.cpu_pool is None else None)
        self._in_flight: tuple[SchedulerOutput, Any, float] | None = None
        self._seq = itertools.count()
        self._prefill_time = 0.0
        self._decode_time = 0.0
        self._last_done = 0.0  # when the previous step's result reached the host (async scheduling)
        self._last_event: Any = None  # CUDA event at the end of the previous step, when the next one follows it
        #: one line per step (wall time, decodes, prefill tokens, device ms) for the load benchmarks
        self._step_log = open(envs.STRATA_STEP_LOG, "a", buffering=1) if envs.STRATA_STEP_LOG else None
        self._closed = False

    # ------------------------------------------------------------------ requests
    def check_request(self, request: EngineCoreRequest) -> None:
        """Raise ValueError if the request can never be served (pure; callable from any thread)."""
        self.scheduler.check_prompt(len(request.prompt_token_ids))

    def add_request(self, request: EngineCoreRequest) -> None:
        req = Request.from_core_request(request, max_model_len=self.max_model_len,
                                        max_pool_tokens=self.scheduler.max_pool_tokens, seq=next(self._seq))
        spec = request.sampling_params.guided_decoding
        if spec is not None:
            req.grammar = self.structured.new_state(spec)  # compiled once per distinct spec (cached)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ------------------------------------------------------------------ stepping
    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and account one step. With nothing schedulable it only reports stats.

        With async scheduling the outputs returned are those of the step launched by the previous call (the
        step launched now reports next time); callers loop while ``has_unfinished_requests()`` either way."""
        gov, pool = self.thread_governor, self.cpu_pool
        if gov is None and pool is None:
            return self._step()
        if pool is not None:
            pool.hold_torch()
        if gov is not None:
            gov.tick()
        out = self._step()
        if not self.has_unfinished_requests():  # idle: hand torch its own thread count back (an in-process engine
            if gov is not None:                 # shares it)
                gov.release()
            if pool is not None:
                pool.release_torch()
        return out

    def _step(self) -> EngineCoreOutputs:
        if self._async:
            return self._step_async()
        sched = self.scheduler.schedule()
        if not sched.chunks:
            return EngineCoreOutputs(outputs=[], stats=self.stats())
        if self.scheduler.num_constrained:
            sched.structured = self.structured.prepare(self.scheduler.sampled_requests(sched), None)
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        self._account(sched, time.perf_counter() - t0)
        outputs = self.scheduler.update_from_output(sched, result)
        return EngineCoreOutputs(outputs=outputs, stats=self.stats())

    def _step_async(self) -> EngineCoreOutputs:
        sched = None
        if self._in_flight is None or self.scheduler.can_schedule_ahead():
            sched = self.scheduler.schedule()
        launched = None
        if sched is not None and sched.chunks:
            if self.scheduler.num_constrained:
                prev_handle = self._in_flight[1] if self._in_flight is not None else None
                sched.structured = self.structured.prepare(self.scheduler.sampled_requests(sched),
                                                           _pending_tokens(prev_handle))
            launched = (sched, self.runner.launch(sched), time.perf_counter())  # type: ignore[attr-defined]
            if sched.structured is not None:
                sched.structured.result()  # matchers are fed before this step's outputs are applied below
        outputs = []
        prev, self._in_flight = self._in_flight, launched
        if prev is not None:
            prev_sched, handle, t0 = prev
            try:
                result = handle.result()
            except BaseException:
                self._in_flight = None
                raise
            # This step's time as its decodes see it: from the previous step's end to its own, on the device's
            # clock when the runner records events (host clocks read a step's end late: only after the next
            # launch, which for a mixed step is long); else from its launch or the previous step's arrival.
            done = time.perf_counter()
            ev = getattr(handle, "done_event", None)
            if ev is not None and self._last_event is not None:
                dt = self._last_event.elapsed_time(ev) / 1e3
            else:
                dt = done - max(t0, self._last_done)
            self._account(prev_sched, dt)
            self._last_done = done
            # the step launched now runs right behind this one; with none launched the device idles next
            self._last_event = ev if launched is not None else None
            outputs = self.scheduler.update_from_output(prev_sched, result)
        return EngineCoreOutputs(outputs=outputs, stats=self.stats())

    def _account(self, sched: SchedulerOutput, dt: float) -> None:
        if sched.total_num_scheduled_tokens > len(sched.chunks):
            self._prefill_time += dt
        else:
            self._decode_time += dt
        budget = self.scheduler.step_budget
        if budget is None and self._step_log is None:
            return
        decodes = sum(len(c.token_ids) == 1 for c in sched.chunks)
        prefill = sched.total_num_scheduled_tokens - decodes
        if budget is not None:
            budget.observe(decodes, prefill, dt)
        if self._step_log is not None:
            self._step_log.write(f"{time.time():.6f} {decodes} {prefill} {dt * 1e3:.3f}\n")

    def idle_work(self) -> bool:
        """Let the runner do one piece of deferred work (graph capture) while nothing runs or waits; True while
        it has more. The core process calls it between polls of an idle input socket."""
        if self.has_unfinished_requests() or self.has_step_in_flight():
            return False
        fn = getattr(self.runner, "idle_work", None)
        return bool(fn()) if fn is not None else False

    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def stats(self) -> SchedulerStats:
        s = self.scheduler.stats()
        s.step_prefill_time = self._prefill_time
        s.step_decode_time = self._decode_time
        return s

    def reset_prefix_cache(self) -> None:
        self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._in_flight = None
            if self._step_log is not None:
                self._step_log.close()
            self.structured.shutdown()
            self.runner.shutdown()


def _pending_tokens(handle: Any):
    """{request id: token} of the step in flight, read when the grammar job needs it (``result()`` of a launched
    step is idempotent and thread-safe)."""
    if handle is None:
        return None

    def tokens() -> dict[str, int]:
        out = handle.result()
        return dict(zip(out.req_ids, out.sampled_token_ids))
    return tokens
