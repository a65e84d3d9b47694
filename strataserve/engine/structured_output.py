"""Structured outputs: grammars compiled with xgrammar, one matcher per constrained request, and the per-step token
bitmask computed on a worker thread while the runner's forward pass runs (vLLM v1's overlap).

Life of a constrained request in the engine core:
- ``add_request``: its ``GuidedDecodingParams`` are compiled once per distinct spec (LRU-cached) and a
  ``GrammarMatcher`` is attached to the ``Request``.
- ``prepare`` (after ``Scheduler.schedule``): when the step samples a constrained request, a job is submitted that
  (async scheduling only) first takes the previous step's tokens and feeds them to the matchers, then fills one
  bitmask row per constrained sampling row. The runner waits for it only right before sampling, so the host work
  overlaps the forward pass on the device (and, on CPU, runs beside torch's GIL-free kernels).
- ``Scheduler.update_from_output`` appends each sampled token; ``advance`` then feeds the matcher every output
  token it has not seen (idempotent: the async job may have fed it already).

The tokenizer is loaded here only when the first constrained request arrives, so token-id-only engines
(``skip_tokenizer_init``) never need one unless they constrain outputs.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from strataserve.grammar import compile_spec, load_xgrammar, tokenizer_info
from strataserve.types.sampling import GuidedDecodingParams

log = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept (a JSON schema grammar is typically 10-500 kB)


@dataclass(slots=True)
class GrammarState:
    """A request's matcher and how many of its output tokens the matcher has consumed."""

    matcher: Any
    num_accepted: int = 0
    failed: bool = False  # a token the grammar rejected (e.g. eos forced by min/max rules): stop constraining
    #: the tokens that end the grammar (the model's eos ids): they end the request too, even with ignore_eos
    stop_ids: frozenset[int] = frozenset()

    def accept(self, token_id: int) -> None:
        if not self.failed and not self.matcher.is_terminated():
            if not self.matcher.accept_token(token_id):
                self.failed = True
        self.num_accepted += 1

    def advance(self, output_token_ids: list[int]) -> None:
        while self.num_accepted < len(output_token_ids):
            self.accept(output_token_ids[self.num_accepted])

    @property
    def active(self) -> bool:
        return not self.failed and not self.matcher.is_terminated()


@dataclass(slots=True)
class GrammarBitmask:
    """One step's constraint: ``rows[j]`` is the sampling row (index among the step's sampled chunks) that
    ``bitmask[j]`` (int32 [R, ceil(vocab / 32)], bit set = allowed) applies to."""

    rows: list[int]
    bitmask: Any  # torch.Tensor int32 on the host


class StructuredStep:
    """Handle on one step's bitmask job; ``result()`` blocks until it is filled (the runner calls it before
    sampling)."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> GrammarBitmask:
        return self._future.result()


class StructuredOutputManager:
    """Compiles grammars, owns the worker thread, builds per-step bitmasks. One per engine core."""

    def __init__(self, tokenizer_path: str | None, vocab_size: int, stop_token_ids: Sequence[int],
                 fill_threads: int = 1) -> None:
        self.tokenizer_path = tokenizer_path
        self.fill_threads = max(1, fill_threads)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._batch: Any = None

    # ------------------------------------------------------------------ compile
    def _get_compiler(self) -> Any:
        if self._compiler is None:
            xgr = load_xgrammar()
            if self.tokenizer_path is None:
                raise ValueError("structured outputs need the model's tokenizer; this engine has none")
            from strataserve.models.tokenizer import Tokenizer

            hf = Tokenizer.from_pretrained(self.tokenizer_path).hf
            info = tokenizer_info(hf, self.vocab_size, self.stop_token_ids)  # special tokens spell no grammar text
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, spec: GuidedDecodingParams) -> Any:
        """The compiled grammar of ``spec`` (cached by spec)."""
        key = (spec.kind, str(getattr(spec, spec.kind)) if spec.kind != "json_object" else "")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = compile_spec(self._get_compiler(), spec)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: GuidedDecodingParams) -> GrammarState:
        matcher = load_xgrammar().GrammarMatcher(self.compile(spec))
        return GrammarState(matcher, stop_ids=frozenset(self.stop_token_ids))

    # ------------------------------------------------------------------ per step
    def prepare(self, sampled: Sequence[Any], pending_tokens: Callable[[], dict[str, int]] | None
                ) -> StructuredStep | None:
        """Start this step's bitmask job, or return None when no sampled request is constrained.

        ``sampled``: the ``Request`` of each sampling chunk, in chunk order. ``pending_tokens`` (async scheduling):
        returns {request id: token} of the step in flight; a constrained request whose last token is pending has
        it fed to its matcher before its row is filled."""
        rows = [j for j, r in enumerate(sampled) if r is not None and r.grammar is not None]
        if not rows:
            return None
        reqs = [sampled[j] for j in rows]
        # num_pending counts this step's sample too: > 1 means the previous step's token is still in flight
        waiting = [r for r in reqs if r.num_pending > 1] if pending_tokens is not None else []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-grammar")
            self._batch = load_xgrammar().BatchGrammarMatcher(max_threads=self.fill_threads)
        return StructuredStep(self._pool.submit(self._fill, rows, reqs, waiting, pending_tokens))

    def _fill(self, rows: list[int], reqs: list[Any], waiting: list[Any],
              pending_tokens: Callable[[], dict[str, int]] | None) -> GrammarBitmask:
        if waiting and pending_tokens is not None:
            tokens = pending_tokens()
            for r in waiting:
                tok = tokens.get(r.request_id)
                if tok is not None and r.grammar.num_accepted == len(r.output_token_ids):
                    r.grammar.accept(tok)  # the in-flight token, which the scheduler has not appended yet
        bitmask = load_xgrammar().allocate_token_bitmask(len(reqs), self.vocab_size)
        live, idx = [], []
        for j, r in enumerate(reqs):
            st = r.grammar
            st.advance(r.output_token_ids)
            if st.active:
                live.append(st.matcher)
                idx.append(j)
            # else the row stays all ones (allocated as -1): nothing left to constrain
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, idx)
        return GrammarBitmask(rows, bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None



def fill_threads_for(device: Any) -> int:
    """``STRATA_GRAMMAR_THREADS``, else 1 for a CPU engine (the model uses its other cores) and half the cores, at
    most 8, for an accelerator's (its host cores are idle while the device runs the forward pass)."""
    from strataserve import envs

    if envs.STRATA_GRAMMAR_THREADS is not None:
        return envs.STRATA_GRAMMAR_THREADS
    if getattr(device, "type", str(device)) == "cpu":
        return 1
    return max(1, min(8, (os.cpu_count() or 2) // 2))
