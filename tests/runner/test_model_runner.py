"""ModelRunner.execute against HF transformers: chunked prefill, cached prefixes, batched decodes, preemption."""
from __future__ import annotations

import pytest
import torch

from _tiny_models import load_hf_model, make_tiny_checkpoint
from runner_driver import Driver
from strataserve.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from strataserve.runner.model_runner import ModelRunner
from strataserve.runner.sampler import Sampler


class RecordingSampler(Sampler):
    """The real sampler, keeping each step's logits so the test can compare them with HF's."""

    def __init__(self) -> None:
        self.logits: list[tuple[list[int], torch.Tensor]] = []

    def __call__(self, logits, reqs):
        self.logits.append(([len(r.prompt_token_ids) + len(r.output_token_ids) for r in reqs], logits.clone()))
        return super().__call__(logits, reqs)


_CKPTS: dict[str, object] = {}


def _ckpt(family, tmp_path_factory):
    if family not in _CKPTS:
        _CKPTS[family] = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family), vocab_size=300,
                                              tokenizer=False)
    return _CKPTS[family]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _ckpt("llama3", tmp_path_factory)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf_model(ckpt)


def make_runner(path, **cache) -> ModelRunner:
    cfg = EngineConfig(ModelConfig(model=str(path), dtype="float32", device="cpu"),
                       CacheConfig(**{"block_size": 4, "num_blocks": 64, **cache}), runner=RunnerConfig(mode="eager"))
    return ModelRunner(cfg, sampler=RecordingSampler())


def check_against_hf(hf, driver: Driver, rids) -> None:
    """Teacher-forced HF pass over each final sequence: every sampled token is HF's argmax at that position."""
    for rid in rids:
        seq = driver.tokens[rid]
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0]
        n_prompt = driver.prompt_len[rid]
        assert seq[n_prompt:] == ref[n_prompt - 1:-1].argmax(-1).tolist(), rid


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3"])
def test_mixed_steps_match_hf_logits(family, tmp_path_factory):
    ckpt = _ckpt(family, tmp_path_factory)
    hf = load_hf_model(ckpt)
    runner = make_runner(ckpt)
    d = Driver(runner, seed=1)
    g = torch.Generator().manual_seed(0)
    pa = torch.randint(5, 300, (11,), generator=g).tolist()
    pb = torch.randint(5, 300, (7,), generator=g).tolist()
    pc = pa[:8] + torch.randint(5, 300, (5,), generator=g).tolist()  # shares A's first 2 blocks
    d.add("A", pa)
    d.add("B", pb)
    assert d.step({"A": 6, "B": 7}).keys() == {"B"}  # A: first chunk only, no sample
    assert d.step({"A": 5, "B": 1}).keys() == {"A", "B"}  # A: second chunk crosses a block boundary
    d.add("C", pc, share_prefix_from=("A", 2))
    d.step({"C": 5, "A": 1, "B": 1})  # C starts after a cached prefix
    for _ in range(6):
        d.decode_all()
    check_against_hf(hf, d, ["A", "B", "C"])
    # Logits, not only argmax: compare every recorded row with HF at the same position.
    rows = {}
    for lens, logits in runner.sampler.logits:
        for n, row in zip(lens, logits):
            rows.setdefault(n, []).append(row)
    for rid in ("A", "B", "C"):
        seq = d.tokens[rid]
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0]
        for n in range(d.prompt_len[rid], len(seq)):
            assert any(torch.allclose(r, ref[n - 1], atol=1e-4) for r in rows[n]), (rid, n)


def test_many_decodes_grouped_and_finish(ckpt, hf):
    """40 sequences of different lengths decode together (several padding groups); finished ones are dropped."""
    runner = make_runner(ckpt, num_blocks=400)
    d = Driver(runner, seed=2, lookahead_blocks=1)
    g = torch.Generator().manual_seed(1)
    rids = [f"r{i}" for i in range(40)]
    for i, rid in enumerate(rids):
        d.add(rid, torch.randint(5, 300, (3 + (i * 7) % 45,), generator=g).tolist())
    d.step({rid: len(d.tokens[rid]) for rid in rids[:20]})
    d.step({rid: len(d.tokens[rid]) for rid in rids[20:]} | {rid: 1 for rid in rids[:20]})
    for _ in range(3):
        d.decode_all()
    check_against_hf(hf, d, rids[::7])
    done = rids[:10]
    for rid in done:
        d.finish(rid)
    d.decode_all()
    assert not set(done) & set(runner.requests)
    assert set(runner.requests) == set(rids[10:])


def test_resume_after_preemption_recomputes(ckpt, hf):
    """A request resumed with outputs recomputes prompt + outputs and continues like the uninterrupted run."""
    runner = make_runner(ckpt)
    d = Driver(runner, seed=3)
    prompt = torch.randint(5, 300, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    d.add("X", prompt)
    d.step({"X": 9})
    for _ in range(4):
        d.decode_all()
    straight = list(d.tokens["X"])
    outputs_so_far = straight[9:12]
    d.finish("X")  # preempted: the runner forgets it, blocks are reused
    d.add("X", prompt, outputs=outputs_so_far)
    d.step({"X": 7})
    d.step({"X": 5})  # recompute in two chunks; the last one samples
    d.decode_all()
    assert d.tokens["X"][:len(straight)] == straight
    assert runner.requests["X"].output_token_ids == d.tokens["X"][9:]
    check_against_hf(hf, d, ["X"])


def test_non_sampling_step_returns_nothing(ckpt):
    runner = make_runner(ckpt)
    d = Driver(runner)
    d.add("A", list(range(5, 25)))
    assert d.step({"A": 8}) == {}
    assert d.step({"A": 8}) == {}
    assert set(d.step({"A": 4})) == {"A"}


def test_modes_kv_sizing_and_limits(ckpt):
    base = dict(model=str(ckpt), dtype="float32", device="cpu")
    for mode in ("triton", "graph", "hybrid"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            ModelRunner(EngineConfig(ModelConfig(**base), runner=RunnerConfig(mode=mode)))
    r = ModelRunner(EngineConfig(ModelConfig(**base, max_model_len=100),
                                 CacheConfig(block_size=16, kv_cache_memory_gib=0.001)))
    # tiny llama3: 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block, one spare
    assert r.num_blocks == int((1 << 30) * 0.001) // (8 * 1024) - 1
    assert r.plan.mode == "eager" and r.block_size == 16 and r.max_model_len == 100
    assert r.kv_caches[0][0].shape == (r.num_blocks + 1, 16, 2, 16)
    assert r.eos_token_ids == (2,)
    r.shutdown()
    r.shutdown()
    with pytest.raises(ValueError, match="max_model_len=5000 exceeds"):
        ModelRunner(EngineConfig(ModelConfig(**base, max_model_len=5000)))
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        ModelRunner(EngineConfig(ModelConfig(**base), CacheConfig(kv_cache_memory_gib=1e-6)))


def test_a_pool_smaller_than_the_context_is_said_at_start(ckpt, caplog):
    base = dict(model=str(ckpt), dtype="float32", device="cpu", max_model_len=512)
    with caplog.at_level("WARNING", logger="strataserve"):
        ModelRunner(EngineConfig(ModelConfig(**base), CacheConfig(block_size=16, num_blocks=8))).shutdown()
    assert "holds 128 tokens, fewer than max_model_len=512" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="strataserve"):
        ModelRunner(EngineConfig(ModelConfig(**base), CacheConfig(block_size=16, num_blocks=32))).shutdown()
    assert "fewer than max_model_len" not in caplog.text


def test_decode_only_steps_go_through_the_graph_hook(ckpt, hf):
    """graph/hybrid modes replay captured decode steps; on CPU a stand-in replays eagerly with the kernels
    helper's ``decode_metadata``, checking the runner's dispatch and that the captured step computes the same."""
    from strataserve.runner.cuda_graph import decode_metadata

    runner = make_runner(ckpt)

    class EagerGraphs:
        calls = 0

        def can_run(self, n, width):
            return True

        def run(self, ids, pos, slots, tables, ctx):
            EagerGraphs.calls += 1
            meta = decode_metadata(slots, tables, ctx, runner.block_size)
            return runner.model.compute_logits(runner.model(ids, pos, meta))

        def close(self):
            pass

    runner.graphs = EagerGraphs()
    d = Driver(runner, seed=4)
    gen = torch.Generator().manual_seed(5)
    d.add("A", torch.randint(5, 300, (10,), generator=gen).tolist())
    d.add("B", torch.randint(5, 300, (6,), generator=gen).tolist())
    d.step({"A": 10, "B": 6})
    assert EagerGraphs.calls == 0  # prefill runs eagerly
    for _ in range(4):
        d.decode_all()
    assert EagerGraphs.calls == 4
    check_against_hf(hf, d, ["A", "B"])


def test_idle_work_captures_the_deferred_decode_graphs_before_the_mixed_step_ones(monkeypatch):
    """Run 21: ``strata serve`` leaves most decode buckets to idle time (``RunnerConfig.defer_cuda_graphs``, set
    by the serve command only); the idle loop captures them one per call, before any mixed-step bucket."""
    from strataserve import envs
    from strataserve.cli import build_parser, engine_config

    calls = []

    class Decode:
        sizes, capture_seconds, left = [1, 8, 16, 24, 32], 0.1, [8, 24]

        def missing(self):
            return list(self.left)

        def capture_next(self):
            calls.append(("decode", self.left.pop()))
            return bool(self.left)

    class Mixed:
        left = 2

        def capture_next(self):
            self.left -= 1
            calls.append(("mixed", self.left))
            return self.left > 0

    runner = object.__new__(ModelRunner)  # only what idle_work reads
    runner.graphs, runner.mixed = Decode(), Mixed()
    results = []
    while True:
        results.append(runner.idle_work())
        if not results[-1]:
            break
    assert calls == [("decode", 24), ("decode", 8), ("mixed", 1), ("mixed", 0)]
    assert results == [True, True, True, False]

    # a capture that fails leaves the graphs captured so far serving (a warning, no crash), then the mixed ones
    from strataserve.runner.cuda_graph import CudaGraphDecoder

    failing = CudaGraphDecoder(lambda *a: a[0], max_bs=16, max_blocks_per_seq=2, device=torch.device("cpu"))
    failing.graphs, failing.outputs = dict.fromkeys([1, 16]), {1: "o1", 16: "o16"}

    def boom(bs):
        raise RuntimeError("CUDA error: out of memory")
    failing._capture_one = boom
    runner.graphs, runner.mixed = failing, Mixed()
    calls.clear()
    assert runner.idle_work() is True and failing.missing() == [] and failing.sizes == [1, 16]
    assert failing.bucket(5) == 16 and failing.outputs == {1: "o1", 16: "o16"}
    assert runner.idle_work() is True and calls == [("mixed", 1)]

    args = build_parser(["serve"]).parse_args(["serve"])
    assert engine_config(args, "m").runner.defer_cuda_graphs is True
    monkeypatch.setattr(envs, "STRATA_SERVE_DEFER_GRAPHS", False)
    assert engine_config(args, "m").runner.defer_cuda_graphs is False
    assert RunnerConfig().defer_cuda_graphs is False  # the offline LLM captures every bucket before it returns
