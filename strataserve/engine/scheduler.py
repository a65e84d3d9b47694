"""Continuous-batching scheduler: decides, every step, which tokens of which requests the runner computes.

One step = one ``SchedulerOutput``. Order of business in ``schedule``:
1. Running requests in admission order, decodes first, then unfinished chunked prefills, each taking
   ``min(tokens left, budget)``. While decodes run, a ``StepBudget`` (if any) caps the prefill tokens of the
   step (these chunks and step 2's) to what keeps it near a target time. Out of KV blocks, it preempts by recompute:
   the victim is the running request with the lowest priority (largest value), newest first; it frees its blocks
   (full computed blocks stay in the prefix cache) and returns to the waiting queue ahead of its priority peers.
2. Waiting requests by (priority, preempted-first, arrival), skipped entirely in a step that preempted. Each takes
   its prefix-cache hit, then as much of the rest as the token budget allows (chunked prefill), subject to
   ``max_num_seqs`` and a small free-block reserve that keeps decodes from thrashing. When the batch is full or
   the pool is out of blocks, a waiting request of strictly higher priority (smaller value) preempts the running
   request of the lowest priority, so a higher SLA class never waits behind a lower one. A step that admits a
   request of a strictly higher priority than every running request runs only that priority level (step 1 is
   skipped): its first token is not slowed by a lower class's batch.

``update_from_output`` appends the sampled tokens, applies the stop rules (eos, stop token ids, max_tokens,
max_model_len; never before min_tokens), frees finished requests and returns one ``EngineCoreOutput`` per sampled
token. Cost per step is O(scheduled requests); nothing scans whole prompts after admission.

Async scheduling (``EngineCore`` with a runner that supports it): ``schedule`` may run again before the previous
step's tokens are applied. A request whose sampled token is still in flight (``num_pending``) gets a one-token
chunk with ``PENDING_TOKEN`` as its id (the runner substitutes the real token on the device), or nothing when
that token ends it by length. Tokens of requests that finished, were aborted or preempted meanwhile are dropped
on arrival (matched by Request identity, not id); a request whose sampling reads its own past tokens on the host
(``Request.sync_only``) turns scheduling-ahead off while it is unfinished.
"""
from __future__ import annotations

import heapq
import time

from strataserve.config import SchedulerConfig
from strataserve.engine.kv_cache_manager import KVCacheManager
from strataserve.engine.step_budget import StepBudget
from strataserve.types.outputs import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from strataserve.types.protocol import EngineCoreOutput, SchedulerStats
from strataserve.engine.request import Request, RequestStatus, check_prompt_length

_RUNNING = RequestStatus.RUNNING
#: token id of a chunk whose token is still being sampled on the device (async scheduling only)
PENDING_TOKEN = -1


class Scheduler:
    def __init__(self, config: SchedulerConfig, *, num_blocks: int, block_size: int, max_model_len: int,
                 enable_prefix_caching: bool = True, step_budget: StepBudget | None = None) -> None:
        self.config = config
        self.step_budget = step_budget  # None: every step may use max_num_batched_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, int, Request]] = []  # heap; aborted entries are skipped lazily
        self.num_waiting = 0
        self._forget: list[str] = []  # ids the runner must drop before the next step
        self._step_reqs: dict[int, list[Request]] = {}  # id(SchedulerOutput) -> Request of each chunk
        self._num_sync_only = 0  # unfinished requests whose sampling reads their past tokens on the host
        self.num_constrained = 0  # unfinished requests with a grammar (structured outputs)
        # Keep ~1% of blocks free when admitting, unless nothing runs (then a lone request may use them all).
        self._reserve = max(1, num_blocks // 100)
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    @property
    def max_pool_tokens(self) -> int:
        return self.kv.num_blocks * self.block_size

    # ------------------------------------------------------------------ requests in / out
    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raise ValueError for a prompt this engine can never serve (pure; safe from any thread)."""
        check_prompt_length(num_prompt_tokens, self.max_model_len, self.max_pool_tokens)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use: use a unique id")
        self.check_prompt(request.num_prompt_tokens)
        self.requests[request.request_id] = request
        self._num_sync_only += request.sync_only
        self.num_constrained += request.grammar is not None
        self._push_waiting(request)

    def _push_waiting(self, req: Request) -> None:
        preempted_first = 0 if req.status == RequestStatus.PREEMPTED else 1
        heapq.heappush(self._waiting, (req.priority, preempted_first, req.seq, req))
        self.num_waiting += 1

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Abort (or otherwise finish) requests now and free their blocks. Unknown ids are ignored."""
        drop_running = False
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self._num_sync_only -= req.sync_only
            self.num_constrained -= req.grammar is not None
            if req.status == _RUNNING:
                drop_running = True
                self._forget.append(rid)
            else:  # still in the waiting heap: skipped lazily when it reaches the top
                self.num_waiting -= 1
            req.status = status
            self.kv.free(req)
        if drop_running:
            self.running = [r for r in self.running if r.status == _RUNNING]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def can_schedule_ahead(self) -> bool:
        """True when the next step may be scheduled before the step in flight returns its tokens (async
        scheduling): no unfinished request samples from its own past tokens on the host."""
        return self._num_sync_only == 0

    def schedule(self) -> SchedulerOutput:
        kv = self.kv
        kv.begin_step()
        full = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk | None] = []
        reqs: list[Request | None] = []  # the Request of each chunk, so update_from_output needs no lookups
        # A request of a strictly higher class than everything running gets a step to itself (and its peers):
        # its first token then waits for no lower-class batch. Lower classes keep their KV and resume next step.
        solo = self._solo_priority()
        preempted = False
        budget = full
        longer: list[Request] = []  # running requests with more than one token to compute (chunked prefills)
        if solo is None and self.running:
            # Decode first: every one-token chunk, then the prefill chunks of running requests under the prefill
            # cap, so a long prompt never delays the decodes' next token.
            budget, preempted = self._schedule_running(self.running, budget, chunks, reqs, longer)
        num_decodes = full - budget  # one token each
        prefill = budget
        if self.step_budget is not None:
            prefill = min(budget, self.step_budget.prefill_cap(num_decodes))
        prefill_cap = prefill
        if longer and prefill > 0:
            prefill, pre = self._schedule_running(longer, prefill, chunks, reqs)
            preempted = preempted or pre

        new_reqs: list[NewRequestData] = []
        if not preempted:
            prefill, preempted = self._admit(prefill, chunks, reqs, new_reqs, solo)

        if preempted:
            chunks = [c for c in chunks if c is not None]
            reqs = [r for r in reqs if r is not None]
        forget: list[str] = []
        if chunks:  # with nothing to run, keep them for the next real step so the runner still drops them
            forget, self._forget = self._forget, []
        total = sum(len(c.token_ids) for c in chunks) if preempted else full - budget + prefill_cap - prefill
        out = SchedulerOutput(new_requests=new_reqs, chunks=chunks, finished_req_ids=forget,  # type: ignore
                              total_num_scheduled_tokens=total)
        if chunks:
            self._step_reqs[id(out)] = reqs  # type: ignore[assignment]
        return out

    def _schedule_running(self, candidates: list[Request], budget: int, chunks: list, reqs: list,
                          longer: list[Request] | None = None) -> tuple[int, bool]:
        """Schedule ``candidates`` (running requests, in admission order) within ``budget`` tokens. With
        ``longer`` given, only those with one token to compute; the others are appended to ``longer`` for a later
        call. Out of blocks, it preempts (see the module docstring). Returns the budget left and whether it
        preempted."""
        allocate, running = self.kv.allocate_slots, self.running
        preempted = False
        for req in list(candidates):
            if budget <= 0:
                break
            if req.status != _RUNNING:
                continue  # preempted earlier in this step
            known = len(req.all_token_ids)
            pending = req.num_pending
            if pending and known + pending >= req.max_len:
                continue  # the token in flight ends it by length: nothing more to compute
            n = known + pending - req.num_computed_tokens
            if n <= 0:
                continue
            if n > 1 and longer is not None:
                longer.append(req)
                continue
            if n > budget:
                n = budget
            blocks = allocate(req, n)
            while blocks is None:
                victim = max(running, key=_victim_key)
                running.remove(victim)
                budget += self._preempt(victim, chunks, reqs)
                preempted = True
                if victim is req:
                    break
                blocks = allocate(req, n)
            if blocks is None:
                continue  # req itself was preempted
            start = req.num_computed_tokens
            end = start + n
            # A pending token's id is known only on the device: the runner takes it from the step in flight.
            toks = [PENDING_TOKEN] if pending else req.all_token_ids[start:end]
            # The block table is passed, not copied: the runner reads it before the scheduler runs again.
            sample = end == known + pending
            chunks.append(ScheduledChunk(req.request_id, toks, start, blocks, sample))
            reqs.append(req)
            req.num_computed_tokens = end
            if sample:
                req.num_pending += 1
            budget -= n
        return budget, preempted

    def _solo_priority(self) -> int | None:
        """The priority of the best waiting request if it beats every running request, else None."""
        waiting, running = self._waiting, self.running
        while waiting and waiting[0][3].status.is_finished:  # aborted while waiting: drop lazily
            heapq.heappop(waiting)
        if not waiting or not running:
            return None
        top = waiting[0][0]
        return top if top < min(r.priority for r in running) else None

    def _admit(self, budget: int, chunks: list, reqs: list, new_reqs: list[NewRequestData],
               max_priority: int | None = None) -> tuple[int, bool]:
        """Admit waiting requests in priority order (none above ``max_priority``); returns the budget left and
        whether it preempted."""
        kv, waiting, running = self.kv, self._waiting, self.running
        preempted = False
        max_seqs = self.config.max_num_seqs
        chunked = self.config.enable_chunked_prefill
        full_budget = self.config.max_num_batched_tokens
        deferred = []
        now = 0.0
        while waiting and budget > 0:
            req = waiting[0][3]
            if req.status.is_finished:  # aborted while waiting
                heapq.heappop(waiting)
                continue
            if max_priority is not None and req.priority > max_priority:
                break
            blocks = None
            if len(running) < max_seqs:
                # prompt logprobs need every prompt position's hidden state: no prefix-cache hit for those
                hit_blocks, hit_tokens = kv.get_computed_blocks(req) if req.prompt_logprobs is None else ([], 0)
                if kv.prefix_in_flight(req, len(hit_blocks)):
                    deferred.append(heapq.heappop(waiting))  # its next block is being computed right now
                    continue
                n = req.num_tokens - hit_tokens
                if n > budget:
                    if chunked:
                        n = budget
                    elif budget < full_budget:
                        break  # no chunking: wait for a step with room for the whole prompt
                reserve = self._reserve if running else 0
                blocks = kv.allocate_slots(req, n, hit_blocks, reserve)
            if blocks is None:  # no slot or no blocks: a lower class may make room
                freed = self._preempt_for(req, chunks, reqs)
                if freed is None:
                    break
                budget += freed
                preempted = True
                continue
            heapq.heappop(waiting)
            self.num_waiting -= 1
            kv.record_lookup(req.num_tokens, hit_tokens)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now = now or time.time()
            req.status = _RUNNING
            running.append(req)
            new_reqs.append(NewRequestData(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                                           req.sampling_params))
            end = hit_tokens + n
            sample = end == req.num_tokens
            chunks.append(ScheduledChunk(req.request_id, req.all_token_ids[hit_tokens:end], hit_tokens, blocks,
                                         sample))
            reqs.append(req)
            req.num_computed_tokens = end
            if sample:
                req.num_pending += 1
            budget -= n
        for entry in deferred:
            heapq.heappush(waiting, entry)
        return budget, preempted

    def _preempt_for(self, req: Request, chunks: list, reqs: list) -> int | None:
        """Make room for ``req`` by preempting the running request of the lowest priority, if that is strictly
        lower than ``req``'s (a higher class never waits behind a lower one for a slot or for blocks). Returns the
        token budget given back, or None when nothing may be preempted."""
        if not self.running:
            return None
        victim = max(self.running, key=_victim_key)
        if victim.priority <= req.priority:
            return None
        self.running.remove(victim)
        return self._preempt(victim, chunks, reqs)

    def _preempt(self, victim: Request, chunks: list, reqs: list) -> int:
        """Preempt ``victim`` (already removed from running) by recompute; return the budget it gave back.

        A token it has in flight (async scheduling) is dropped when it arrives and recomputed after resumption.
        """
        returned = 0
        for idx, r in enumerate(reqs):  # O(batch), but only on preemption
            if r is victim:  # scheduled earlier in this step: undo that first
                chunk = chunks[idx]
                chunks[idx] = reqs[idx] = None
                returned = len(chunk.token_ids)
                victim.num_computed_tokens -= returned
                break
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_pending = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._forget.append(victim.request_id)
        self._push_waiting(victim)
        return returned

    # ------------------------------------------------------------------ results of one step
    def sampled_requests(self, sched: SchedulerOutput) -> list[Request | None]:
        """The ``Request`` of each sampling chunk of a step this scheduler produced, in chunk order."""
        reqs = self._step_reqs.get(id(sched)) or [self.requests.get(c.req_id) for c in sched.chunks]
        return [r for c, r in zip(sched.chunks, reqs) if c.sample]

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        requests = self.requests
        cache_computed = self.kv.cache_computed
        reqs = self._step_reqs.pop(id(sched), None)
        if reqs is None or len(reqs) != len(sched.chunks):  # an output this scheduler did not record
            reqs = [requests.get(c.req_id) for c in sched.chunks]
        n_decodes = 0  # single-token sampling chunks; every other token counts as prefill (incl. recompute)
        sampled: list[Request | None] = []
        plp = result.prompt_logprobs
        for c, req in zip(sched.chunks, reqs):
            if req is not None and req.status == _RUNNING:
                cache_computed(req)
                if plp and c.req_id in plp:
                    req.add_prompt_logprobs(*plp[c.req_id])
            if c.sample:
                sampled.append(req)
                if len(c.token_ids) == 1:
                    n_decodes += 1
        self.prompt_tokens += sched.total_num_scheduled_tokens - n_decodes

        outputs: list[EngineCoreOutput] = []
        logprobs = result.logprobs
        any_finished = False
        if len(sampled) != len(result.req_ids):
            raise RuntimeError(f"the runner sampled {len(result.req_ids)} tokens for {len(sampled)} sampling chunks")
        for j, (rid, tok) in enumerate(zip(result.req_ids, result.sampled_token_ids)):
            req = sampled[j]
            if req is None:
                continue  # (unrecorded output only) aborted since it was scheduled
            if req.request_id != rid:
                raise RuntimeError(f"runner output {j} is for {rid!r}, not the sampling chunk's request: the runner "
                                   "must return tokens in chunk order")
            if req.status != _RUNNING:
                continue  # aborted or preempted after it was scheduled (identity, not id: ids may be reused)
            req.num_pending -= 1
            finished = req.append_token(tok)
            if req.grammar is not None:
                req.grammar.advance(req.output_token_ids)
            lp = logprobs[j] if logprobs else None
            out = EngineCoreOutput(request_id=rid, new_token_ids=[tok], new_logprobs=None if lp is None else [lp])
            if not req._sent_first:
                req._sent_first = True
                out.num_cached_tokens = req.num_cached_tokens
                out.queued_time = req.queued_time
                out.scheduled_time = req.first_scheduled_time
                out.prompt_logprobs = req.prompt_logprobs
            if finished:
                any_finished = True
                out.finish_reason = req.status.finish_reason
                out.stop_reason = req.stop_reason
                out.num_preemptions = req.num_preemptions
                del requests[rid]
                self._num_sync_only -= req.sync_only
                self.num_constrained -= req.grammar is not None
                self.kv.free(req)
                self._forget.append(rid)
            outputs.append(out)
        self.generation_tokens += len(outputs)
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return outputs

    def stats(self) -> SchedulerStats:
        kv = self.kv
        return SchedulerStats(
            num_running=len(self.running), num_waiting=self.num_waiting, kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_blocks,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens)


def _victim_key(r: Request) -> tuple[int, float, int]:
    return (r.priority, r.arrival_time, r.seq)
