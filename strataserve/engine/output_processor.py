"""Front-end bookkeeping: turns ``EngineCoreOutputs`` (token ids) into user-facing ``RequestOutput``s.

Per request it detokenises, applies stop strings (reporting requests the core must abort), converts logprobs
to vLLM's ``list[dict[int, Logprob]]``, fans ``n > 1`` in (child core requests ``"{id}-{i}"``) and records
metrics. Two output kinds:
- ``FINAL_ONLY``: one cumulative ``RequestOutput`` when every completion has finished (offline ``LLM``). With no
  stop strings the text is decoded once at the end, which keeps big offline batches cheap.
- ``DELTA``: each output carries only what is new (text, token ids, logprobs) for the completions that changed,
  identified by ``CompletionOutput.index``; the last one has ``finished=True`` (streaming server).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from strataserve.engine.detokenizer import (IncrementalDetokenizer, TokenTextCache, decode_all, make_decode)
from strataserve.types.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from strataserve.types.protocol import EngineCoreOutputs, EngineCoreRequest
from strataserve.types.sampling import RequestOutputKind, SamplingParams


def _ended_by_token(finish: str | None, stop_reason: int | str | None, params: SamplingParams) -> bool:
    """True when the last token is the eos or a stop token id: as vLLM, its text stays out of the output unless
    ``include_stop_str_in_output`` (a stop token id need not be special: a newline, say; its id stays in
    ``token_ids``)."""
    return finish == "stop" and not isinstance(stop_reason, str) and not params.include_stop_str_in_output


def child_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seed for completion ``index`` of an ``n > 1`` request (index 0 keeps ``seed``)."""
    if index == 0:
        return seed
    # 31 bits: valid for every RNG a sampler may seed (torch, numpy, random).
    return xxhash.xxh64_intdigest(f"{seed}:{index}".encode()) & 0x7FFF_FFFF


@dataclass(slots=True)
class _Completion:
    index: int
    core_id: str
    parent: "_Request"
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    raw_logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # DELTA bookkeeping: token ids / logprobs already handed out


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    metrics: RequestMetrics
    children: list[_Completion] = field(default_factory=list)
    num_unfinished: int = 0
    num_cached_tokens: int = 0
    changed: list[_Completion] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    #: core request ids finished here by a stop string: abort them in the engine core
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode = make_decode(tokenizer) if tokenizer is not None else None
        self._token_text = TokenTextCache(self._decode) if self._decode is not None else None
        self._requests: dict[str, _Request] = {}
        self._by_core_id: dict[str, _Completion] = {}

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    *, eos_token_id: int | None = None, priority: int = 0, arrival_time: float | None = None,
                    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> list[EngineCoreRequest]:
        """Register a request; return the engine-core requests to send (one per completion)."""
        n = params.n
        core_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        if request_id in self._requests or any(c in self._by_core_id for c in core_ids):
            raise ValueError(f"request id {request_id!r} is already in use: use a unique id")
        arrival = arrival_time or time.time()
        req = _Request(request_id, prompt, prompt_token_ids, params, kind, RequestMetrics(arrival_time=arrival),
                       num_unfinished=n)
        lazy_text = kind is RequestOutputKind.FINAL_ONLY and not params.stop
        core_reqs = []
        for i, cid in enumerate(core_ids):
            child_params = params
            if n > 1:
                child_params = replace(params, n=1, seed=None if params.seed is None else child_seed(params.seed, i))
            detok = None
            if self._decode is not None and not lazy_text:
                detok = IncrementalDetokenizer(self._decode, prompt_token_ids, params)
            comp = _Completion(i, cid, req, detok, raw_logprobs=[] if params.logprobs is not None else None,
                               cumulative_logprob=0.0 if params.logprobs is not None else None)
            req.children.append(comp)
            self._by_core_id[cid] = comp
            core_reqs.append(EngineCoreRequest(request_id=cid, prompt_token_ids=prompt_token_ids,
                                               sampling_params=child_params, eos_token_id=eos_token_id,
                                               arrival_time=arrival, priority=priority))
        self._requests[request_id] = req
        return core_reqs

    def abort_output(self, request_id: str) -> RequestOutput | None:
        """The last output of a request the user aborts: its prompt, metrics and each unfinished completion ending
        with "abort" (nothing new in it: a DELTA; the consumer's CUMULATIVE view keeps what came before)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        outs = [CompletionOutput(c.index, "", [], c.cumulative_logprob, [] if c.raw_logprobs is not None else None,
                                 finish_reason="abort") for c in req.children if c.finish_reason is None]
        return RequestOutput(request_id, req.prompt, req.prompt_token_ids, outs, finished=True,
                             num_cached_tokens=req.num_cached_tokens, metrics=req.metrics)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these requests; return their core request ids (still unfinished) to abort in the core."""
        core_ids = []
        for rid in request_ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            for c in req.children:
                self._by_core_id.pop(c.core_id, None)
                if c.finish_reason is None:
                    core_ids.append(c.core_id)
        return core_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ outputs
    def process_outputs(self, core_outputs: EngineCoreOutputs) -> ProcessedOutputs:
        now = time.time()
        by_core_id = self._by_core_id
        touched: list[_Request] = []
        to_abort: list[str] = []
        for o in core_outputs.outputs:
            comp = by_core_id.get(o.request_id)
            if comp is None or comp.finish_reason is not None:
                continue  # aborted by the user, or already finished by a stop string
            req = comp.parent
            if not req.changed:
                touched.append(req)
            if not comp.token_ids:
                self._first_output(req, o, now)
            req.changed.append(comp)
            comp.token_ids.extend(o.new_token_ids)
            if o.prompt_logprobs is not None and req.prompt_logprobs is None:
                req.prompt_logprobs = [None, *self._convert(o.prompt_logprobs)]
            if comp.raw_logprobs is not None and o.new_logprobs:
                comp.raw_logprobs.extend(o.new_logprobs)
                comp.cumulative_logprob += sum(lp.logprob for lp in o.new_logprobs)  # type: ignore[operator]
            finish, stop_reason = o.finish_reason, o.stop_reason
            new_ids = o.new_token_ids
            if _ended_by_token(finish, stop_reason, req.params) and new_ids:
                new_ids = new_ids[:-1]  # as vLLM: the eos / stop token's own text is not part of the output
            if comp.detok is not None and new_ids:
                stop = comp.detok.update(new_ids)
                if stop is not None:
                    if finish is None:
                        to_abort.append(o.request_id)
                    finish, stop_reason = "stop", stop
            if finish is not None:
                comp.finish_reason, comp.stop_reason = finish, stop_reason
                req.num_unfinished -= 1
        outs = []
        for req in touched:
            ro = self._make_output(req, now)
            req.changed.clear()
            if ro is not None:
                outs.append(ro)
        return ProcessedOutputs(outs, to_abort)

    def _first_output(self, req: _Request, o: Any, now: float) -> None:
        m = req.metrics
        if m.first_token_time is None and o.new_token_ids:
            m.first_token_time = now
        if o.scheduled_time is not None and (m.first_scheduled_time is None or o.scheduled_time < m.first_scheduled_time):
            m.first_scheduled_time = o.scheduled_time
        if o.num_cached_tokens and req.children[0].core_id == o.request_id:
            req.num_cached_tokens = o.num_cached_tokens

    def _make_output(self, req: _Request, now: float) -> RequestOutput | None:
        finished = req.num_unfinished == 0
        if finished:
            req.metrics.finished_time = now
            self._requests.pop(req.request_id, None)
            for c in req.children:
                self._by_core_id.pop(c.core_id, None)
        if req.kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            comps = [self._final(c) for c in req.children]
        else:
            seen: set[int] = set()
            comps = []
            for c in req.changed:
                if c.index not in seen:
                    seen.add(c.index)
                    comps.append(self._delta(c))
        plp = req.prompt_logprobs if not req.prompt_logprobs_sent else None  # sent once (DELTA)
        if plp is not None and req.kind is RequestOutputKind.DELTA:
            req.prompt_logprobs_sent = True
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=comps, finished=finished, num_cached_tokens=req.num_cached_tokens,
                             metrics=req.metrics, prompt_logprobs=plp)

    def _final(self, c: _Completion) -> CompletionOutput:
        if c.detok is not None:
            c.detok.finish()
            text = c.detok.text
        elif self._decode is not None:
            ids = c.token_ids[:-1] if _ended_by_token(c.finish_reason, c.stop_reason, c.parent.params) else c.token_ids
            text = decode_all(self._decode, c.parent.prompt_token_ids, ids, c.parent.params.skip_special_tokens)
        else:
            text = ""
        return CompletionOutput(c.index, text, c.token_ids, c.cumulative_logprob, self._logprobs(c, 0),
                                c.finish_reason, c.stop_reason)

    def _delta(self, c: _Completion) -> CompletionOutput:
        done = c.finish_reason is not None
        text = ""
        if c.detok is not None:
            if done:
                c.detok.finish()
            text = c.detok.delta(done)
        start, c.sent_tokens = c.sent_tokens, len(c.token_ids)
        return CompletionOutput(c.index, text, c.token_ids[start:], c.cumulative_logprob, self._logprobs(c, start),
                                c.finish_reason, c.stop_reason)

    def _logprobs(self, c: _Completion, start: int) -> list[dict[int, Logprob]] | None:
        return None if c.raw_logprobs is None else self._convert(c.raw_logprobs[start:])

    def _convert(self, raw: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        """The engine's TokenLogprobs -> vLLM's {token id: Logprob} per position (chosen token first)."""
        tt = self._token_text
        out = []
        for lp in raw:
            d = {lp.token_id: Logprob(lp.logprob, lp.rank, tt(lp.token_id) if tt else None)}
            for rank, (tid, val) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
                if tid not in d:
                    d[tid] = Logprob(val, rank, tt(tid) if tt else None)
            out.append(d)
        return out
