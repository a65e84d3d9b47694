"""Async streaming engine front end used by the HTTP server: ``async for out in llm.generate(...)``.

One background task (the *pump*) awaits ``CoreClient.get_outputs``, turns token ids into ``RequestOutput`` deltas
with the ``OutputProcessor`` and hands each to its request's collector; stop-string finishes are aborted in the
core from there. ``generate`` validates first (ValueError saying what to change; nothing reaches the core), and a
consumer that stops iterating -- ``break``, ``aclose()``, task cancellation on client disconnect -- aborts the
request in the core, which frees its KV blocks at the next step boundary.

Length policy (same as vLLM): a prompt must leave room for at least one output token (else ValueError);
``max_tokens`` beyond what is left of ``max_model_len`` is clipped and the completion ends with "length".
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, AsyncIterator

from strataserve.config import EngineConfig
from strataserve.engine.core_client import CoreClient, InprocCoreClient
from strataserve.types.errors import EngineDeadError
from strataserve.engine.input_processor import (InputProcessor, PromptType, as_tokenizer, load_tokenizer,
                                                model_config_or_none)
from strataserve.engine.output_processor import OutputProcessor, RequestOutputKind
from strataserve.types.outputs import CompletionOutput, RequestOutput
from strataserve.types.protocol import SchedulerStats
from strataserve.types.sampling import SamplingParams
from strataserve.runner.base import ModelRunnerBase


class _Collector:
    """Latest undelivered output of one request; deltas that pile up while the consumer is slow are merged.

    With ``interval`` > 1 the consumer is woken only once the merged delta holds ``interval`` new tokens (or the
    request finished, or it is the first output): the stream interval. The consumer waits on a bare future
    (created only when it has to wait): this runs once per streamed token, and an ``asyncio.Event`` costs a future
    plus a waiter list per wait."""

    __slots__ = ("out", "err", "waiter", "n", "interval", "ready", "started")

    def __init__(self, n: int, interval: int = 1) -> None:
        self.out: RequestOutput | None = None
        self.err: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.n = n
        self.interval = interval
        self.ready = False  # ``out`` may be handed over
        self.started = False  # the first output has been handed over

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def put(self, out: RequestOutput) -> None:
        if self.out is None:
            self.out = out
        else:
            _merge(self.out, out)
        if not self.ready:
            merged = self.out
            self.ready = (self.interval <= 1 or merged.finished or not self.started
                          or max((len(c.token_ids) for c in merged.outputs), default=0) >= self.interval)
            if self.ready:
                self._wake()

    def fail(self, exc: BaseException) -> None:
        self.err = exc
        self._wake()

    async def get(self) -> RequestOutput:
        while not self.ready:
            if self.err is not None:
                raise self.err
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out, self.out = self.out, None
        self.ready, self.started = False, True
        return out  # type: ignore[return-value]


def _merge(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished = new.finished
    into.metrics = new.metrics
    into.num_cached_tokens = new.num_cached_tokens


class AsyncLLM:
    def __init__(self, engine_config: EngineConfig, core_client: CoreClient | None = None, tokenizer: Any = None) -> None:
        self.config = engine_config
        if tokenizer is None:
            tokenizer = load_tokenizer(engine_config.model.tokenizer or engine_config.model.model,
                                       engine_config.model.skip_tokenizer_init)
        #: strataserve ``Tokenizer`` (``.hf`` is the transformers tokenizer)
        self.tokenizer = as_tokenizer(tokenizer)
        self.core = core_client if core_client is not None else InprocCoreClient(engine_config)
        info = self.core.info
        self.inputs = InputProcessor(self.tokenizer, info.max_model_len, info.max_pool_tokens,
                                     model_config_or_none(engine_config.model.model))
        #: token ids a prompt may use (config.json's vocab_size, which may exceed the tokenizer's ids)
        self.vocab_size: int | None = self.inputs.vocab_size
        self.outputs = OutputProcessor(self.tokenizer.hf if self.tokenizer is not None else None)
        #: the core's latest SchedulerStats (before its first step: an idle pool of the size it reported)
        self.stats: SchedulerStats | None = SchedulerStats(num_total_blocks=info.num_blocks,
                                                          num_free_blocks=info.num_blocks)
        self._collectors: dict[str, _Collector] = {}
        self.stream_interval = engine_config.scheduler.stream_interval
        self._pump: asyncio.Task | None = None
        self._pump_error: BaseException | None = None
        self._closed = False

    @classmethod
    def from_engine_args(cls, engine_args: Any, **_: Any) -> "AsyncLLM":
        """vLLM's way to build one: ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=DIR, ...))``. The engine core
        runs in its own process, as the server's does (call it under ``if __name__ == "__main__":``); vLLM's
        other keywords (``start_engine_loop``, ``usage_context``) do not apply and are ignored."""
        from strataserve.engine.mp_client import MPCoreClient

        config = engine_args.create_engine_config()
        client = MPCoreClient(config, wait=False)
        try:
            tokenizer = load_tokenizer(config.model.tokenizer or config.model.model, config.model.skip_tokenizer_init)
            client.wait_ready()
            return cls(config, core_client=client, tokenizer=tokenizer)
        except BaseException:
            client.shutdown()
            raise

    @classmethod
    def from_config(cls, engine_config: EngineConfig, *, runner: ModelRunnerBase | None = None,
                    tokenizer: Any = None) -> "AsyncLLM":
        """An AsyncLLM whose engine core steps on a background thread of this process."""
        from strataserve.engine.engine_core import EngineCore

        if tokenizer is None:
            tokenizer = load_tokenizer(engine_config.model.tokenizer or engine_config.model.model,
                                       engine_config.model.skip_tokenizer_init)
        return cls(engine_config, InprocCoreClient(core=EngineCore(engine_config, runner)), tokenizer)

    # ------------------------------------------------------------------ health
    @property
    def max_model_len(self) -> int:
        return self.core.info.max_model_len

    @property
    def dead_error(self) -> BaseException | None:
        return self.core.dead_error or self._pump_error

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine core (or the output pump) has died."""
        self.core.check_health()
        if self._pump_error is not None:
            raise EngineDeadError(f"engine output loop died: {self._pump_error!r}") from self._pump_error

    # ------------------------------------------------------------------ requests
    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as ``sampling_params.output_kind`` says (vLLM's): CUMULATIVE (the default) the
        text and tokens so far, DELTA only the new ones (the server's kind: nothing copied per token), FINAL_ONLY
        the finished output alone. The last has finished=True. Closing the iterator early aborts the request."""
        deltas = self._deltas(prompt, sampling_params, request_id, priority)
        kind = getattr(sampling_params, "output_kind", RequestOutputKind.DELTA)  # not SamplingParams: _deltas says
        return deltas if kind is RequestOutputKind.DELTA else _accumulate(deltas, kind)

    async def _deltas(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                      priority: int) -> AsyncIterator[RequestOutput]:
        self.check_health()
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use: use a unique id")
        text, ids, params = self.inputs.process(prompt, sampling_params)
        core_reqs = self.outputs.add_request(request_id, text, ids, params, eos_token_id=self.inputs.eos_token_id,
                                             priority=priority, kind=RequestOutputKind.DELTA)
        collector = self._collectors[request_id] = _Collector(params.n, self.stream_interval)
        finished = False
        try:
            for r in core_reqs:
                self.core.add_request(r)
            self._ensure_pump()
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort_now(request_id, notify=False)
            self._collectors.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream (if any) ends with finish_reason "abort". Unknown ids are ignored."""
        self._abort_now(request_id, notify=True)

    def _abort_now(self, request_id: str, notify: bool) -> None:
        collector = self._collectors.get(request_id)
        final = self.outputs.abort_output(request_id) if notify and collector is not None else None
        core_ids = self.outputs.abort_requests([request_id])
        if core_ids:
            self.core.abort_requests(core_ids)
        if final is not None and collector is not None:
            collector.put(final)

    # ------------------------------------------------------------------ output pump
    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump(), name="strata-output-pump")

    async def _run_pump(self) -> None:
        core, outputs, collectors = self.core, self.outputs, self._collectors
        try:
            while True:
                batch = await core.get_outputs()
                if batch.stats is not None:
                    self.stats = batch.stats
                processed = outputs.process_outputs(batch)
                for ro in processed.request_outputs:
                    c = collectors.get(ro.request_id)
                    if c is not None:
                        c.put(ro)
                if processed.reqs_to_abort:
                    core.abort_requests(processed.reqs_to_abort)
                await asyncio.sleep(0)  # get_outputs may not suspend when batches queue up: let consumers run
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every waiting stream must learn about it
            if not isinstance(exc, EngineDeadError):
                self._pump_error = exc
            err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine output loop died: {exc!r}")
            for c in list(collectors.values()):
                c.fail(err)

    def shutdown(self) -> None:
        """Stop the pump and the engine core; pending streams end with EngineDeadError. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._pump is not None and not self._pump.done():
            try:
                self._pump.cancel()
            except RuntimeError:  # its event loop is already closed: the task dies with it
                pass
        err = EngineDeadError("the engine has been shut down")
        for c in list(self._collectors.values()):
            c.fail(err)
        self.core.shutdown()


async def _accumulate(deltas: Any, kind: RequestOutputKind) -> AsyncIterator[RequestOutput]:
    acc = _Accumulated()
    try:
        async for out in deltas:
            whole = acc.add(out)
            if kind is RequestOutputKind.CUMULATIVE or out.finished:
                yield whole
    finally:
        await deltas.aclose()  # a consumer that stops early aborts the request now, not when this is collected


class _Accumulated:
    """DELTA outputs summed into what vLLM's CUMULATIVE kind yields: each completion's text, ids and logprobs so
    far (the prompt's logprobs, sent once, kept)."""

    def __init__(self) -> None:
        self.outputs: dict[int, CompletionOutput] = {}
        self.prompt_logprobs: Any = None

    def add(self, out: RequestOutput) -> RequestOutput:
        for c in out.outputs:
            have = self.outputs.get(c.index)
            if have is None:
                have = self.outputs[c.index] = CompletionOutput(c.index, "", [], None,
                                                                [] if c.logprobs is not None else None)
            have.text += c.text
            have.token_ids = have.token_ids + list(c.token_ids)
            if c.logprobs is not None:
                have.logprobs = (have.logprobs or []) + list(c.logprobs)
            if c.cumulative_logprob is not None:
                have.cumulative_logprob = c.cumulative_logprob
            have.finish_reason, have.stop_reason = c.finish_reason, c.stop_reason
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        return replace(out, outputs=[replace(o) for _, o in sorted(self.outputs.items())],
                       prompt_logprobs=self.prompt_logprobs)
