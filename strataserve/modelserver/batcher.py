"""Scheduler of one model version: priority queues, the dynamic batcher, and one worker per instance.

Invariants: a queued request is in exactly one deque (its priority level's, or `delayed` once its timeout hit
with action DELAY); only the event-loop thread touches the queues; an instance runs one execution at a time
(its worker awaits the instance's own executor thread). Without `dynamic_batching` each request executes alone.

Faults in model code stay with the requests that caused them: when an execution of several requests raises,
each is run again alone, so only the culprits fail (not done for decoupled models, which may have answered
already). With ``parameters { key: "EXECUTION_TIMEOUT_MS" ... }`` an execution that runs longer fails its
requests with DEADLINE_EXCEEDED; an isolated Python model's process is then killed (and restarted), an
in-process one's thread is abandoned and the instance gets a fresh thread, so later requests are not blocked.

An execution runs with its requests' caller bound (``KSERVE_CALLER``), so the BLS calls a Python model makes are
checked and charged as that caller's (``router/repo_llm.py``); a Python model's batch therefore holds one
caller's requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from strataserve.modelserver.backends.base import Backend, BackendRequest
from strataserve.modelserver.config import ConfigError, ModelSpec
from strataserve.modelserver.stats import BACKEND, OTHER, REJECTED, ModelStats
from strataserve.types.tensors import KSERVE_CALLER, ModelServerError

log = logging.getLogger(__name__)
TIMEOUT_KEY = "EXECUTION_TIMEOUT_MS"


def execution_timeout_s(spec: ModelSpec) -> float | None:
    """The model's ``parameters.EXECUTION_TIMEOUT_MS`` in seconds (None: no timeout)."""
    raw = spec.parameters.get(TIMEOUT_KEY)
    if raw in (None, ""):
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms > 0:
        raise ConfigError(spec.source, f"parameters.{TIMEOUT_KEY}", f"'{raw}' is not a positive number of "
                          "milliseconds")
    return ms / 1000.0


def batch_cut(rows: Sequence[int], preferred: Sequence[int], max_rows: int, delay_s: float,
              waited_s: float) -> int | None:
    """How many of the leading candidates (their row counts in queue order, together within max_rows) to execute
    now; None: wait for more requests. Triton's GetDynamicBatch: the largest prefix that is a preferred size goes
    at once (when the queue already holds more than the largest preferred size, the prefix below it goes); a batch
    that reached the largest preferred size (max_rows without preferred sizes) goes at once; otherwise the oldest
    request waits up to the delay, after which every candidate goes."""
    largest = preferred[-1] if preferred else max_rows
    best = total = 0
    for i, r in enumerate(rows):
        if total and total + r > largest and not best:
            best = i  # no preferred size below the overflow: what precedes it is as large as a batch should be
        total += r
        if total in preferred:
            best = i + 1
    exceeded = delay_s > 0 and waited_s >= delay_s
    if best and not exceeded:
        return best
    if total >= largest or exceeded or delay_s <= 0:
        return len(rows)
    return None


class Pending:
    """One queued request; results flow to `events` as (outputs, error, final) tuples. `failure`: the failure
    reason (stats.py) an error delivered to it counts under: the model's fault unless the scheduler says else."""

    __slots__ = ("request", "level", "enqueued_ns", "timer", "events", "shape_key", "queue_ns", "loop", "failure")

    def __init__(self, request: BackendRequest, level: int, loop: asyncio.AbstractEventLoop):
        self.request, self.level, self.loop = request, level, loop
        self.enqueued_ns = time.monotonic_ns()
        self.timer: asyncio.TimerHandle | None = None
        self.events: asyncio.Queue = asyncio.Queue()
        self.queue_ns = 0
        self.failure = BACKEND
        # Requests batch together only when every non-batch dim and dtype agree.
        self.shape_key = tuple((k, v.shape[1:], v.dtype.str) for k, v in sorted(request.inputs.items()))

    def push(self, outputs: Any, error: BaseException | None, final: bool) -> None:
        """Thread-safe (decoupled models send from their own threads)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (outputs, error, final))
        except RuntimeError:
            pass  # the event loop has closed (server stopped): nobody is waiting for this response

    def deliver(self, outputs: Any, error: BaseException | None, final: bool) -> None:
        """Event-loop thread only: skips the cross-thread wake-up of push()."""
        self.events.put_nowait((outputs, error, final))


class Scheduler:
    def __init__(self, spec: ModelSpec, version: int, instances: list[Backend], stats: ModelStats):
        self.spec, self.version, self.instances, self.stats = spec, version, instances, stats
        db = spec.dynamic_batching
        self.batching = db is not None and spec.max_batch_size > 0
        self.max_rows = spec.max_batch_size if self.batching else 0
        self.preferred = db.preferred_batch_sizes if db else ()
        self.delay_s = (db.max_queue_delay_us / 1e6) if db else 0.0
        self.levels = max(db.priority_levels, 1) if db else 1
        self.default_level = (db.default_priority_level or 1) if db else 1
        self.queues: list[deque[Pending]] = [deque() for _ in range(self.levels)]
        self.delayed: deque[Pending] = deque()
        self.changed = asyncio.Event()
        self.timeout_s = execution_timeout_s(spec)
        self.per_caller = spec.backend == "python"  # its BLS calls are one caller's (module doc)
        self.executors = [self._executor() for _ in instances]
        self.workers = [asyncio.create_task(self._worker(i)) for i in range(len(instances))]
        self.running = 0
        self.closing = False

    # -- admission ---------------------------------------------------------------------------------------------
    def submit(self, request: BackendRequest, priority: int, timeout_us: int | None) -> Pending:
        if self.closing:
            raise self._unloaded()
        loop = asyncio.get_running_loop()
        db = self.spec.dynamic_batching
        # Triton's InferenceRequest::SetPriority: 0 or a priority outside 1..priority_levels is the default level.
        level = priority if 1 <= priority <= self.levels else self.default_level
        if not db or not db.priority_levels:
            level = 1
        policy = db.policy(level) if db else None
        if policy and policy.max_queue_size and len(self.queues[level - 1]) >= policy.max_queue_size:
            raise ModelServerError("unavailable", f"model '{self.spec.name}' version {self.version}: queue full "
                                   f"(max_queue_size {policy.max_queue_size} at priority level {level})")
        p = Pending(request, level, loop)
        if self.per_caller:
            p.shape_key += (request.caller,)
        timeout = policy.default_timeout_us if policy else 0
        if timeout_us and (policy is None or not policy.configured):
            timeout = timeout_us  # no queue policy in the config: the request's own timeout holds
        elif timeout_us and policy.allow_timeout_override:
            # model_config.proto: a request may set a timeout less than the default but may not increase it
            timeout = min(timeout_us, timeout) if timeout else timeout_us
        if timeout:
            p.timer = loop.call_later(timeout / 1e6, self._expire, p, policy.timeout_action if policy else "REJECT",
                                      timeout)
        self.queues[level - 1].append(p)
        self.changed.set()
        return p

    def cancel(self, p: Pending) -> None:
        """The consumer of `p` went away (event-loop thread). A queued request leaves the queue now, not when a
        busy instance next forms a batch: its max_queue_size slot, its timer and its tensors are freed at once, and
        the batcher re-plans without it (what is left may already be a batch). A running one's model is told."""
        p.request.cancel()
        if self._unqueue(p):
            self.changed.set()

    def _unqueue(self, p: Pending) -> bool:
        """Take `p` out of its queue and stop its timeout timer; False when it is not queued (executing)."""
        for q in (self.queues[p.level - 1], self.delayed):
            if p in q:
                q.remove(p)
                break
        else:
            return False
        if p.timer:
            p.timer.cancel()
            p.timer = None
        return True

    def _expire(self, p: Pending, action: str, timeout_us: int) -> None:
        p.timer = None
        q = self.queues[p.level - 1]
        if p not in q:
            return  # already executing
        q.remove(p)
        if action == "DELAY":  # keep it, but behind every request that has not timed out
            self.delayed.append(p)
            return
        p.failure = REJECTED  # Triton: a request that times out in the queue was rejected, never ran
        p.push(None, ModelServerError("deadline_exceeded", f"model '{self.spec.name}' version {self.version}: "
                                      f"request timed out after {timeout_us} us in the queue"), True)

    def queued(self) -> int:
        return sum(len(q) for q in self.queues) + len(self.delayed)

    # -- batch formation ---------------------------------------------------------------------------------------
    def _ordered(self):
        for q in self.queues:
            yield from q
        yield from self.delayed

    def _take(self, batch: list[Pending]) -> list[Pending]:
        for p in batch:
            self._unqueue(p)
        return batch

    async def _next_batch(self) -> list[Pending]:
        while True:
            self.changed.clear()
            first = next(self._ordered(), None)
            if first is None:
                await self.changed.wait()
                continue
            if not self.batching:
                return self._take([first])
            cands, rows = [], 0
            for p in self._ordered():
                if p.shape_key == first.shape_key and rows + p.request.rows <= self.max_rows:
                    cands.append(p)
                    rows += p.request.rows
            waited = (time.monotonic_ns() - first.enqueued_ns) / 1e9
            cut = batch_cut([p.request.rows for p in cands], self.preferred, self.max_rows, self.delay_s, waited)
            if cut is not None:
                return self._take(cands[:cut])
            try:
                await asyncio.wait_for(self.changed.wait(), self.delay_s - waited)
            except asyncio.TimeoutError:
                pass

    # -- execution ---------------------------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix=f"model-{self.spec.name}")

    async def _worker(self, index: int) -> None:
        while True:
            try:
                batch = await self._next_batch()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a scheduling bug must not silently kill the instance's worker
                log.exception("model %s: batch formation failed", self.spec.name)
                await asyncio.sleep(0.01)
                continue
            start = time.monotonic_ns()
            for p in batch:
                p.queue_ns = start - p.enqueued_ns
            self.running += 1
            try:
                await self._execute(index, batch)
            finally:
                self.running -= 1

    async def _execute(self, index: int, batch: list[Pending]) -> None:
        try:
            results, times = await self._call(index, [p.request for p in batch])
        except BaseException as e:  # noqa: BLE001 - one bad execution fails its requests, not the worker
            if isinstance(e, asyncio.CancelledError):
                for p in batch:
                    p.failure = OTHER  # the server stopped under it: not the model's fault
                    p.push(None, self._unloaded(), True)
                raise
            err = e if isinstance(e, ModelServerError) else ModelServerError(
                "internal", f"model '{self.spec.name}' version {self.version}: {type(e).__name__}: {e}")
            # a backend refusing the joined inputs (invalid_argument) may be refusing one request's part of them
            if len(batch) > 1 and not self.spec.decoupled and err.code in ("internal", "invalid_argument"):
                for p in batch:  # find the requests that fail on their own; the others still get answers
                    await self._execute(index, [p])
                return
            for p in batch:
                p.push(None, err, True)
            return
        self.stats.execution_done(len(batch), sum(p.request.rows for p in batch), *times)
        if len(results) != len(batch):  # a backend bug must not leave requests waiting forever
            results = [ModelServerError("internal", f"model '{self.spec.name}': the backend answered "
                                        f"{len(results)} of {len(batch)} requests")] * len(batch)
        for p, r in zip(batch, results):
            if isinstance(r, BaseException):
                p.deliver(None, r, True)
            elif r is not None:
                p.deliver(r, None, True)
            elif not self.spec.decoupled:
                p.deliver(None, ModelServerError("internal", f"model '{self.spec.name}' gave no response"), True)

    async def _call(self, index: int, requests: list[BackendRequest]):
        """Run one execution on the instance's thread, bounded by the model's execution timeout."""
        loop = asyncio.get_running_loop()
        instance = self.instances[index]
        if self.timeout_s is None:
            return await loop.run_in_executor(self.executors[index], self._run, instance, requests)
        # Waiting for a restarting instance is not execution time: only the model's own work is timed.
        await loop.run_in_executor(self.executors[index], instance.wait_ready)
        fut = loop.run_in_executor(self.executors[index], self._run, instance, requests)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            log.error("model %s: an execution passed %s=%s", self.spec.name, TIMEOUT_KEY,
                      self.spec.parameters.get(TIMEOUT_KEY))
            if not instance.on_timeout():
                self.executors[index].shutdown(wait=False)  # its thread is stuck in model code: leave it
                self.executors[index] = self._executor()
            raise ModelServerError("deadline_exceeded", f"model '{self.spec.name}' version {self.version}: the "
                                   f"execution did not finish within {self.timeout_s * 1000:.0f} ms "
                                   f"(parameters.{TIMEOUT_KEY} in config.pbtxt)") from None

    @staticmethod
    def _run(instance: Backend, requests: list[BackendRequest]):
        caller = KSERVE_CALLER.set(requests[0].caller)  # the model's BLS calls are its caller's (module doc)
        try:
            t0 = time.perf_counter_ns()
            prepared = instance.prepare(requests)
            t1 = time.perf_counter_ns()
            result = instance.infer(prepared)
            t2 = time.perf_counter_ns()
            results = instance.finish(result, requests)
            t3 = time.perf_counter_ns()
        finally:
            KSERVE_CALLER.reset(caller)
        return results, (t1 - t0, t2 - t1, t3 - t2)

    def _unloaded(self) -> ModelServerError:
        return ModelServerError("unavailable", f"model '{self.spec.name}' version {self.version} was unloaded")

    async def close(self) -> None:
        """Refuse new requests, finish the queued and running ones (as Triton does on unload), then release
        the instances."""
        self.closing = True
        while self.queued() or self.running:
            await asyncio.sleep(0.005)
        for w in self.workers:
            w.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        # the cancelled tasks keep their CancelledError, whose traceback's frames hold this scheduler: dropping
        # them breaks that cycle, so an unloaded version is freed at once, not at the next full collection
        self.workers.clear()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: [i.close() for i in self.instances])
        for ex in self.executors:
            ex.shutdown(wait=False)
