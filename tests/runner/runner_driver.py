"""A minimal stand-in for the scheduler: hands ``ModelRunner.execute`` hand-planned steps.

Blocks come from a shuffled free list (so block tables are non-contiguous); each step names how many tokens of
each request to compute; a chunk samples when it reaches the last known token, like the real scheduler.
"""
from __future__ import annotations

import random

from strataserve.types.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from strataserve.types.sampling import SamplingParams


class Driver:
    def __init__(self, runner, seed: int = 0, lookahead_blocks: int = 0) -> None:
        """``lookahead_blocks``: extra blocks each table owns beyond the step's need (like a scheduler that
        allocates ahead), which the runner must ignore."""
        self.runner = runner
        self.lookahead = lookahead_blocks
        self.bs = runner.block_size
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.pending_new: list[NewRequestData] = []
        self.pending_finished: list[str] = []

    def add(self, rid: str, prompt: list[int], params: SamplingParams | None = None,
            share_prefix_from: tuple[str, int] | None = None, outputs: list[int] | None = None) -> None:
        """``share_prefix_from=(other, n_blocks)``: reuse the other request's first blocks as a cached prefix."""
        params = params or SamplingParams(temperature=0.0, max_tokens=64)
        self.tokens[rid] = list(prompt) + list(outputs or [])
        self.prompt_len[rid] = len(prompt)
        self.tables[rid], self.computed[rid] = [], 0
        if share_prefix_from is not None:
            other, nb = share_prefix_from
            assert self.tokens[other][:nb * self.bs] == self.tokens[rid][:nb * self.bs]
            self.tables[rid] = self.tables[other][:nb]
            self.computed[rid] = nb * self.bs
        self.pending_new.append(NewRequestData(rid, list(prompt), list(outputs or []), params))

    def finish(self, rid: str) -> None:
        self.pending_finished.append(rid)
        for d in (self.tokens, self.tables, self.computed, self.prompt_len):
            d.pop(rid)

    def step(self, plan: dict[str, int]) -> dict[str, int]:
        """plan: request id -> number of tokens to compute this step. Returns sampled tokens by request id."""
        chunks = []
        for rid, n in plan.items():
            start = self.computed[rid]
            toks = self.tokens[rid][start:start + n]
            assert len(toks) == n, f"{rid}: only {len(self.tokens[rid]) - start} tokens left to compute"
            while len(self.tables[rid]) * self.bs < start + n + self.lookahead * self.bs:
                self.tables[rid].append(self.free.pop())
            chunks.append(ScheduledChunk(rid, toks, start, list(self.tables[rid]),
                                         sample=start + n == len(self.tokens[rid])))
            self.computed[rid] = start + n
        out = self.runner.execute(SchedulerOutput(self.pending_new, chunks, self.pending_finished,
                                                  sum(plan.values())))
        self.pending_new, self.pending_finished = [], []
        expected = [c.req_id for c in chunks if c.sample]
        assert out.req_ids == expected
        for rid, tok in zip(out.req_ids, out.sampled_token_ids):
            self.tokens[rid].append(tok)
        return dict(zip(out.req_ids, out.sampled_token_ids))

    def decode_all(self) -> dict[str, int]:
        return self.step({rid: 1 for rid in self.tokens})
