"""Dynamic batching of whole requests for a non-autoregressive runner (Triton-style): one worker thread waits for
a request, keeps collecting for ``window_s`` (or until ``max_batch`` are waiting), groups what it has by what must
match inside one batch (``num_step``, guidance on/off), runs each group to completion on the runner, decodes the
audio and hands every request its result through its callback (on the worker thread).

A long speech request is several runner requests (sentence pieces) that its front submits a few at a time, the
next from the callback of one that finished (``omnivoice_tts.OmniVoiceStream``): a callback may call ``submit``,
and what it submits is waiting before the worker collects its next batch, so other requests interleave between
pieces instead of queueing behind the whole clip.

The audio decode runs on a second thread (on its own CUDA stream on a GPU), so a batch's clips are decoded while
the next batch unmasks: on one thread the device sat idle between batches for the codec's many small launches (one
clip per forward, ~8 ms per 10 s clip), and 32 clips put ~0.25 s between two batches. One decoded batch may wait
behind the one decoding (a bounded hand-over), so unmasking never runs far ahead of the audio.

Invariants: a request's callback is called exactly once (result or exception), unless it was cancelled while
still waiting; a running batch runs its ``num_step`` forwards unless every request in it is cancelled, when it
stops at the next step; ``shutdown`` lets the batches already unmasked finish decoding, fails the waiting requests
with ``EngineDeadError`` and joins both threads, and a ``submit`` after that raises instead of waiting forever. A request's tokens depend on its seed, never on its
batch (the runner's per-request generators); the audio decode must not depend on it either: give ``decode`` one
clip per forward (``_OmniVoiceBase`` does), as a batched convolution can round differently from a lone one.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from strataserve.types.errors import EngineDeadError
from strataserve.runner.nar_runner import NARRequest, NARRunner

#: (request, tokens [C, T] or None, waveform float32 [samples] or None, error or None)
Done = Callable[[NARRequest, "torch.Tensor | None", "torch.Tensor | None", "BaseException | None"], None]
Decode = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class _Job:
    request: NARRequest
    done: Done
    cancelled: bool = False


class NARScheduler:
    def __init__(self, runner: NARRunner, decode: Decode | None, *, window_s: float = 0.005, max_batch: int = 32,
                 max_canvas_tokens: int = 65536) -> None:
        if max_batch < 1 or window_s < 0:
            raise ValueError("max_batch must be >= 1 and window_s >= 0")
        self.runner, self.decode = runner, decode
        self.window_s, self.max_batch, self.max_canvas_tokens = window_s, max_batch, max_canvas_tokens
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self.num_running = 0
        self.dead_error: BaseException | None = None
        self._stop = False
        self._closed = False  # set by _fail_waiting: no submit is accepted after it
        # unmasked batches -> the decode thread (None: stop); maxsize 1: one waits while one decodes
        self._decoding: queue.Queue[tuple[list[_Job], list[torch.Tensor], object] | None] = queue.Queue(maxsize=1)
        self._decoder = threading.Thread(target=self._decode_loop, name="strata-nar-decode", daemon=True) \
            if decode is not None else None
        self._thread = threading.Thread(target=self._loop, name="strata-nar", daemon=True)
        if self._decoder is not None:
            self._decoder.start()
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._queue.qsize()

    def check_health(self) -> None:
        if self.dead_error is not None or self._stop or not self._thread.is_alive() or \
                (self._decoder is not None and not self._decoder.is_alive()):
            raise EngineDeadError(f"the speech scheduler stopped: {self.dead_error or 'shut down'}")

    def submit(self, request: NARRequest, done: Done) -> None:
        """Queue one request (thread-safe; also from a callback on the worker thread)."""
        self.check_health()
        job = _Job(request, done)
        with self._lock:  # under the lock: _fail_waiting either sees this job or has closed the door before it
            if self._closed:
                raise EngineDeadError(f"the speech scheduler stopped: {self.dead_error or 'shut down'}")
            self._jobs[request.request_id] = job
        self._queue.put(job)

    def cancel(self, request_id: str) -> None:
        """A waiting request is dropped (no callback); a running one gets no callback either, and a running batch
        whose requests are all cancelled stops at its next step."""
        with self._lock:
            job = self._jobs.pop(request_id, None)
        if job is not None:
            job.cancelled = True

    def _collect(self, first: _Job) -> list[_Job]:
        jobs, deadline = [first], time.perf_counter() + self.window_s
        while len(jobs) < self.max_batch:
            left = deadline - time.perf_counter()
            try:
                job = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # keep the stop marker for the loop
                break
            jobs.append(job)
        return [j for j in jobs if not j.cancelled]

    def _groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        """Same num_step and guidance on/off per batch; a batch's canvas stays under ``max_canvas_tokens``."""
        by_key: dict[tuple[int, bool], list[_Job]] = {}
        for j in jobs:
            s = j.request.settings
            by_key.setdefault((s.num_step, s.guidance_scale != 0), []).append(j)
        out = []
        for group in by_key.values():
            group.sort(key=lambda j: j.request.cond_len)  # similar lengths together: less padding
            batch: list[_Job] = []
            for j in group:
                if batch and 2 * (len(batch) + 1) * (j.request.cond_len + self.runner.len_step) > \
                        self.max_canvas_tokens:
                    out.append(batch)
                    batch = []
                batch.append(j)
            out.append(batch)
        return out

    def _run(self, batch: list[_Job]) -> None:
        self.num_running = len(batch)
        try:
            # every request of the batch cancelled (its clients hung up): the rest of its steps are not run
            tokens = self.runner.generate([j.request for j in batch], lambda: all(j.cancelled for j in batch))
        except Exception as exc:  # noqa: BLE001 -- one bad batch fails its requests, not the server
            for j in batch:
                self._finish(j, None, None, exc)
            return
        finally:
            self.num_running = 0
        if tokens is None or self._decoder is None:
            for j, tok in zip(batch, tokens or [None] * len(batch)):
                self._finish(j, tok, None, None)
            return
        ready = None
        if tokens and tokens[0].is_cuda:  # the decode stream waits for the unmasking's last kernels, not for all
            ready = torch.cuda.Event()
            ready.record()
        while True:  # (a decode thread that died takes nothing more: then this thread stops too)
            try:
                self._decoding.put((batch, tokens, ready), timeout=0.5)
                return
            except queue.Full:
                if not self._decoder.is_alive():
                    raise EngineDeadError(f"the speech decode thread stopped: {self.dead_error}") from None

    def _decode_loop(self) -> None:
        try:
            self._decode_batches()
        except BaseException as exc:  # noqa: BLE001 -- recorded; check_health reports it, waiting requests fail
            self.dead_error = exc

    def _decode_batches(self) -> None:
        stream: torch.cuda.Stream | None = None
        while (item := self._decoding.get()) is not None:
            batch, tokens, ready = item
            try:
                if all(j.cancelled for j in batch):
                    wavs: list = [None] * len(batch)
                else:
                    if ready is not None and stream is None:
                        stream = torch.cuda.Stream(tokens[0].device)
                    with torch.cuda.stream(stream) if ready is not None else contextlib.nullcontext():
                        if ready is not None:
                            stream.wait_event(ready)
                        assert self.decode is not None
                        wavs = self.decode(tokens)
                    if stream is not None:
                        stream.synchronize()  # callbacks read the samples on the host, from any stream
            except Exception as exc:  # noqa: BLE001 -- a failed decode fails its batch's requests only
                for j in batch:
                    self._finish(j, None, None, exc)
                continue
            for j, tok, wav in zip(batch, tokens, wavs):
                self._finish(j, tok, wav, None)

    def _finish(self, job: _Job, tokens, wav, err) -> None:
        with self._lock:
            self._jobs.pop(job.request.request_id, None)
        if not job.cancelled:
            job.done(job.request, tokens, wav, err)

    def _loop(self) -> None:
        try:
            while True:
                first = self._queue.get()
                if first is None or self._stop:  # stopping: what still waits is failed below, not run
                    return
                for batch in self._groups(self._collect(first)):
                    self._run(batch)
        except BaseException as exc:  # noqa: BLE001 -- recorded; check_health reports it
            self.dead_error = exc
        finally:
            if self._decoder is not None and self._decoder.is_alive():  # unmasked batches get their audio first
                self._decoding.put(None)
                self._decoder.join()
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        err = EngineDeadError(f"the speech scheduler stopped: {self.dead_error or 'shut down'}")
        with self._lock:
            self._closed = True
            jobs, self._jobs = list(self._jobs.values()), {}
        for j in jobs:
            if not j.cancelled:
                j.done(j.request, None, None, err)

    def shutdown(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._queue.put(None)
        self._thread.join(timeout=30)
