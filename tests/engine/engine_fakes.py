"""A deterministic fake model runner that checks the scheduler -> runner contract while it runs.

The "model" picks the next token as a pure function of the context (``next_token``), so a request's output is
independent of batching, chunking, preemption and prefix caching; ``reference_output`` computes it directly.
The fake KV cache stores the token id written at each slot; before every chunk the runner checks that every
earlier position in the chunk's block table holds that request's token, which catches a wrong prefix-cache hit,
a block shared while being written, or a block table that lost a block.
"""
from __future__ import annotations

import time

from strataserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from strataserve.types.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from strataserve.engine.scheduler import PENDING_TOKEN
from strataserve.runner.base import ModelRunnerBase

VOCAB = 400  # = the test tokenizer's vocabulary, so fake outputs always decode
EOS = 2


def next_token(tokens: list[int]) -> int:
    # Depends on the last two tokens and the length; avoids EOS unless a test scripts it.
    t = (tokens[-1] * 1103515245 + (tokens[-2] if len(tokens) > 1 else 7) * 69069 + len(tokens) * 12345) % VOCAB
    return t if t != EOS else EOS + 1


def reference_output(prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = (), min_tokens: int = 0,
                     eos: int | None = None, max_len: int | None = None) -> list[int]:
    toks, out = list(prompt), []
    while True:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if len(out) >= min_tokens and (t == eos or t in stop_ids):
            return out
        if len(out) >= max_tokens or (max_len is not None and len(toks) >= max_len):
            return out


class FakeRunner(ModelRunnerBase):
    supports_async = False

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256, verify: bool = True,
                 logprobs: bool = False, delay_s: float = 0.0, fail_at_step: int | None = None) -> None:
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.verify = verify
        self.want_logprobs = logprobs
        self.kv = [[-1] * block_size for _ in range(num_blocks)]
        self.state: dict[str, list[int]] = {}
        self.steps: list[SchedulerOutput] = []
        self.record = verify
        self.shut = False
        self.delay_s = delay_s  # sleep per step, so async tests can act while a request is still running
        self.fail_at_step = fail_at_step  # raise inside execute at this step (engine-death tests)
        self.num_steps = 0
        self.num_pending_chunks = 0  # chunks whose token was still being "sampled" (async scheduling)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("fake runner exploded")
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.record:
            self.steps.append(so)
        state, bs, kv = self.state, self.block_size, self.kv
        for rid in so.finished_req_ids:
            assert rid in state, f"runner told to forget unknown request {rid}"
            del state[rid]
        for nr in so.new_requests:
            assert nr.req_id not in state, f"request {nr.req_id} sent twice without being forgotten"
            state[nr.req_id] = list(nr.prompt_token_ids) + list(nr.output_token_ids)
        ids, toks_out, lps = [], [], []
        for c in so.chunks:
            toks = state[c.req_id]
            n, start, bt = len(c.token_ids), c.start_pos, c.block_table
            if c.token_ids and c.token_ids[0] == PENDING_TOKEN:  # async scheduling: the token sampled last step
                assert self.supports_async, f"{c.req_id}: pending token sent to a synchronous runner"
                assert n == 1 and start == len(toks) - 1, f"{c.req_id}: pending token at the wrong position"
                self.num_pending_chunks += 1
            elif self.verify:
                assert toks[start:start + n] == c.token_ids, f"{c.req_id}: chunk tokens disagree with the request"
                assert len(bt) * bs >= start + n, f"{c.req_id}: block table too short"
                assert c.sample == (start + n == len(toks)), f"{c.req_id}: wrong sample flag"
                for p in range(start):
                    assert kv[bt[p // bs]][p % bs] == toks[p], f"{c.req_id}: KV at position {p} is not its token"
            for p in range(start, start + n):
                kv[bt[p // bs]][p % bs] = toks[p]
            if c.sample:
                t = next_token(toks)
                toks.append(t)
                ids.append(c.req_id)
                toks_out.append(t)
                lps.append(TokenLogprobs(t, -0.5, 1, [t, t + 1], [-0.5, -1.5]) if self.want_logprobs else None)
        return ModelRunnerOutput(ids, toks_out, lps)

    def shutdown(self) -> None:
        self.shut = True


class _Done:
    def __init__(self, out: ModelRunnerOutput) -> None:
        self.out = out

    def result(self) -> ModelRunnerOutput:
        return self.out


class AsyncFakeRunner(FakeRunner):
    """A runner that lets the engine schedule ahead: ``launch`` "runs" the step at once (its own state is the
    device's truth, so a pending token is whatever it sampled last) and ``result`` hands the tokens over later."""

    supports_async = True

    def launch(self, so: SchedulerOutput) -> _Done:
        return _Done(self.execute(so))


def engine_config(*, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096, prefix: bool = True,
                  chunked: bool = True, target_step_ms: float | None = 0.0, stream_interval: int = 1) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="fake"),
        cache=CacheConfig(enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=chunked, target_step_ms=target_step_ms,
                                  stream_interval=stream_interval),
    )
