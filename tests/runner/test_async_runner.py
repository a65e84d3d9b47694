"""The real ModelRunner under async scheduling (forced on, on CPU): step N+1 is built and run with the tokens
step N sampled taken from its token tensor. Greedy outputs must equal HF generate() token for token, under
chunked prefill, prefix-cache hits, stop tokens mid-flight and preemption."""
from __future__ import annotations

import random

import pytest

from _tiny_models import hf_greedy, make_tiny_checkpoint
from strataserve.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from strataserve.engine.engine_core import EngineCore
from strataserve.types.protocol import EngineCoreRequest
from strataserve.types.sampling import SamplingParams
from strataserve.runner.model_runner import ModelRunner

MAX_NEW = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), vocab_size=300, tokenizer=False)


class EagerGraphs:
    """Stands in for ``CudaGraphDecoder`` on CPU: "replays" the runner's capturable decode step eagerly, so the
    runner's graph-path logic (logits and in-graph argmax outputs, gathers, the skipped sampler) runs here too."""

    def __init__(self, runner) -> None:
        self.runner, self.calls = runner, 0

    def can_run(self, batch: int, num_block_cols: int) -> bool:
        return batch > 0

    def missing(self) -> list[int]:  # every "bucket" is there (nothing for idle_work to capture)
        return []

    def run(self, *args):
        self.calls += 1
        return self.runner._graph_step(*args)

    def close(self) -> None:
        pass


def run_engine(path, prompts, num_blocks, budget, stop=None, async_scheduling=True, fake_graphs=None):
    """``fake_graphs``: a list; when given, the runner gets an ``EagerGraphs``, appended to it."""
    cfg = EngineConfig(ModelConfig(model=str(path), dtype="float32", device="cpu"),
                       CacheConfig(block_size=4, num_blocks=num_blocks),
                       SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
                       RunnerConfig(mode="eager"))
    runner = ModelRunner(cfg, async_scheduling=async_scheduling)
    if fake_graphs is not None:
        runner.graphs = EagerGraphs(runner)
        fake_graphs.append(runner.graphs)
    core = EngineCore(cfg, runner=runner)
    for i, p in enumerate(prompts):
        stops = list(stop.get(i, ())) if stop else []
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=p, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=stops)))
    outs: dict[str, list[int]] = {}
    in_flight_seen = 0
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        in_flight_seen += core.has_step_in_flight()
    pool = core.scheduler.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    stats = core.stats()
    core.shutdown()
    return [outs[str(i)] for i in range(len(prompts))], in_flight_seen, stats


def test_async_runner_matches_hf_with_chunking_prefix_hits_stops_and_preemption(ckpt):
    rng = random.Random(0)
    shared = [rng.randrange(5, 300) for _ in range(8)]
    prompts = [shared + [rng.randrange(5, 300) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    ref = hf_greedy(ckpt, prompts, MAX_NEW)
    # ample KV, a small token budget (chunked prefill mixed with decodes)
    got, in_flight, _ = run_engine(ckpt, prompts, num_blocks=128, budget=16)
    assert in_flight > 0
    assert got == ref
    # a KV pool too small for the batch: preemption while a step is in flight
    got, _, stats = run_engine(ckpt, prompts, num_blocks=24, budget=32)
    assert stats.num_preemptions > 0
    assert got == ref
    # a stop token hit while the next step is already running: the extra token is dropped
    stop = {0: (ref[0][3],), 3: (ref[3][0],)}
    got, _, _ = run_engine(ckpt, prompts, num_blocks=128, budget=64, stop=stop)
    for i, r in enumerate(ref):
        if i in stop:
            assert got[i] == r[:r.index(stop[i][0]) + 1]
        else:
            assert got[i] == r


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_graph_path_argmax_matches_hf(ckpt, async_scheduling):
    """Decode steps through the graph path: all-greedy steps take the decode step's own argmax (no sampler)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 300) for _ in range(rng.randint(2, 15))] for _ in range(4)]
    graphs: list = []
    got, _, _ = run_engine(ckpt, prompts, num_blocks=64, budget=24, async_scheduling=async_scheduling,
                           fake_graphs=graphs)
    assert graphs[0].calls >= MAX_NEW - 2  # the decode-only steps went through the graph path
    assert got == hf_greedy(ckpt, prompts, MAX_NEW)
