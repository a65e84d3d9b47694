"""Tensor parallelism end to end on CPU: ``LLM(tensor_parallel_size=2)`` runs rank 0 here and rank 1 in a worker
process (gloo). Greedy float32 tokens equal TP=1's and HF transformers' on a tiny checkpoint of every family,
the logprobs agree, and the worker is gone after shutdown."""
from __future__ import annotations

import json
import os

import pytest

from _tiny_models import hf_greedy, make_tiny_checkpoint
from strataserve import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 33, 70, 2, 8, 41, 17, 99, 250, 3, 61, 7, 18, 200, 12, 90], [1, 300, 4, 4, 100]]
VARIANTS = {
    # name: (family, HF config overrides)
    "llama3-gqa-odd-vocab": ("llama3", dict(vocab_size=509)),  # 509 = 2 x 255 - 1: the last vocab shard is padded
    "mistral-one-kv-head": ("mistral", {}),  # 1 KV head < 2 ranks: replicated
    "qwen2-bias-tied": ("qwen2", dict(vocab_size=512)),
    "qwen3-qknorm": ("qwen3", dict(vocab_size=512)),
}
MAX_TOKENS = 10


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too (reaped by its parent later)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _generate(path, tp: int, **kw):
    llm = LLM(path, dtype="float32", device="cpu", skip_tokenizer_init=True, tensor_parallel_size=tp, num_blocks=64,
              block_size=4, max_num_batched_tokens=16, **kw)  # chunked prefill over 4-token blocks
    runner = llm.engine.core.runner
    workers = runner.tp_setup.workers
    pids = workers.pids if workers is not None else []
    assert all(_alive(p) for p in pids)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    try:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert not any(_alive(p) for p in pids), "a tensor-parallel worker outlived its engine"
    return outs, pids


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_greedy_equals_tp1_and_hf(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(family, tmp_path, tokenizer=False, **overrides)
    tp2, pids = _generate(path, 2)
    assert len(pids) == 1
    tp1, _ = _generate(path, 1)
    ref = hf_greedy(path, PROMPTS, MAX_TOKENS)
    assert [o.token_ids for o in tp2] == ref
    assert [o.token_ids for o in tp1] == ref
    for a, b in zip(tp2, tp1):  # the logits behind them agree too, not only their argmax
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            for tok in la:
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


def test_dummy_weights_at_tp2_equal_tp1_with_config_json_only(tmp_path):
    src = make_tiny_checkpoint("llama", tmp_path / "src", tokenizer=False, vocab_size=512)
    only_config = tmp_path / "shape"
    only_config.mkdir()
    (only_config / "config.json").write_text((src / "config.json").read_text())
    tp2, _ = _generate(only_config, 2, load_format="dummy")
    tp1, _ = _generate(only_config, 1, load_format="dummy")
    assert [o.token_ids for o in tp2] == [o.token_ids for o in tp1]


def test_sizes_that_do_not_fit_are_refused_before_any_worker_starts(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, tokenizer=False, vocab_size=256)
    assert json.loads((path / "config.json").read_text())["num_attention_heads"] == 4
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not fit this model: num_attention_heads=4"):
        LLM(path, device="cpu", skip_tokenizer_init=True, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(path, device="cpu", skip_tokenizer_init=True, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="load_format='safetensor'"):
        LLM(path, device="cpu", skip_tokenizer_init=True, load_format="safetensor")


def test_cli_flags_reach_the_engine_config():
    from strataserve.cli import build_parser, engine_config

    args = build_parser().parse_args(["generate", "--prompt", "x", "-tp", "2", "--load-format", "dummy"])
    cfg = engine_config(args, "some/folder")
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.model.load_format == "dummy"
    assert engine_config(build_parser().parse_args(["serve"]), "m").parallel.tensor_parallel_size == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tensor-parallel-size", "0"])


def test_async_scheduling_sends_rank0_samples_to_the_workers(tmp_path):
    """Under async scheduling a step carries placeholders for tokens still being sampled; the workers must fill
    them with rank 0's samples. Rank 0 samples the second most likely token here, so a worker that used anything
    else (its own argmax, say) would hold other KV and the outputs would drift from TP=1's."""
    import torch

    from strataserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from strataserve.runner.model_runner import ModelRunner
    from strataserve.runner.sampler import Sampler

    class SecondBest(Sampler):
        def sample(self, logits, reqs):
            return logits.topk(2, dim=-1).indices[:, 1], [None] * len(reqs)

    path = make_tiny_checkpoint("qwen3", tmp_path, tokenizer=False, vocab_size=512)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = {}
    for tp in (2, 1):
        cfg = EngineConfig(ModelConfig(str(path), dtype="float32", device="cpu", skip_tokenizer_init=True),
                           CacheConfig(num_blocks=64, block_size=4), SchedulerConfig(max_num_batched_tokens=16),
                           parallel=ParallelConfig(tensor_parallel_size=tp))
        llm = LLM(path, runner=ModelRunner(cfg, SecondBest(), async_scheduling=True), skip_tokenizer_init=True)
        assert llm.engine.core._async and llm.engine.core.scheduler.can_schedule_ahead()
        try:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert outs[2] == outs[1]
    assert outs[1] != hf_greedy(path, PROMPTS, MAX_TOKENS)  # the sampler did pick other tokens than greedy
    assert torch.tensor(outs[1]).unique().numel() > 4  # and not one repeated token


def test_worker_exits_when_rank0_is_killed(tmp_path):
    """A SIGKILLed engine runs no shutdown code: its worker must notice on its own and leave."""
    import signal
    import subprocess
    import sys
    import time

    path = make_tiny_checkpoint("llama", tmp_path, tokenizer=False, vocab_size=256)
    script = ("import sys, time\nfrom strataserve import LLM\n"
              f"llm = LLM({str(path)!r}, device='cpu', skip_tokenizer_init=True, tensor_parallel_size=2, num_blocks=8)\n"
              "print(llm.engine.core.runner.tp_setup.workers.pids[0], flush=True)\ntime.sleep(600)\n")
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(rank0.stdout.readline())
        assert _alive(worker)
    finally:
        rank0.send_signal(signal.SIGKILL)
        rank0.wait()
    deadline = time.monotonic() + 30  # a bound for a loaded CI machine, not a speed check
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), "the worker outlived its killed rank 0"


def test_tp2_with_int8_kv_cache_equals_tp1(tmp_path):
    # each rank calibrates the scales of its own KV heads in the same collective forward: the split changes nothing
    family, overrides = VARIANTS["qwen3-qknorm"]
    path = make_tiny_checkpoint(family, tmp_path, tokenizer=False, **overrides)
    tp2, _ = _generate(path, 2, kv_cache_dtype="int8")
    tp1, _ = _generate(path, 1, kv_cache_dtype="int8")
    assert [o.token_ids for o in tp2] == [o.token_ids for o in tp1]


def test_router_config_entry_sets_tensor_parallelism_and_kv_dtype(tmp_path):
    from strataserve.cli import _entry_engine, build_parser
    from strataserve.router.config import parse_config
    from strataserve.router.local_replicas import resolve_gpus

    doc = {"models": [{"name": "big", "path": str(tmp_path), "tensor_parallel_size": 2, "load_format": "dummy",
                       "kv_cache_dtype": "int8", "device": "cuda"},
                      {"name": "small", "path": str(tmp_path)}]}
    big, small = parse_config(doc).models
    args = build_parser().parse_args(["serve"])
    cfg = _entry_engine(args, big)
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.model.load_format == "dummy"
    assert cfg.cache.kv_cache_dtype == "int8"
    assert resolve_gpus(None, cfg, 8) == 2  # a replica of a TP=2 model takes two GPUs
    assert _entry_engine(args, small).parallel.tensor_parallel_size == 1
