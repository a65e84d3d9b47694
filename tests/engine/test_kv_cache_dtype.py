"""fp8 / int8 KV cache end to end on the trained demo model (CPU, eager attention over the quantised cache):
next-token agreement with the float cache, capacity, and the errors for what cannot run."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from strataserve import LLM, SamplingParams
from strataserve.assets import DEMO_MODEL_DIR
from strataserve.config import CacheConfig
from strataserve.kernels.kv_quant_ref import FP8
from strataserve.runner.kv_quant import resolve_kv_cache_dtype

PROMPTS = ["The weather today is", "Once upon a time, there was a", "My favourite food is",
           "The best way to learn is", "In the morning I like to", "A good friend is someone who",
           "The old house at the end of the street", "She opened the door and saw"]
NEW_TOKENS = 128
CHUNK = 16  # prefill chunks of 16: every position past the first chunk attends over K/V read back from the cache
BLOCKS = len(PROMPTS) * (NEW_TOKENS + 48) // 16 + 8


def _llm(**kw) -> LLM:
    return LLM(str(DEMO_MODEL_DIR), device="cpu", num_blocks=BLOCKS, max_num_batched_tokens=CHUNK,
               enable_prefix_caching=False, **kw)


def _argmaxes(llm: LLM, seqs: list[list[int]]) -> list[list[int]]:
    """Teacher-forced greedy tokens: the top-1 prediction at every position of each given sequence."""
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)
    return [[next(t for t, lp in d.items() if lp.rank == 1) for d in o.prompt_logprobs[1:]] for o in outs]


@pytest.fixture(scope="module")
def reference() -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    """8 sequences of prompt + 128 greedy tokens from the float32 cache, and its teacher-forced argmaxes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine's cores are shared: one thread keeps the tiny model's steps steady
    llm = _llm()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    yield seqs, _argmaxes(llm, seqs)
    torch.set_num_threads(before)  # the later test modules get the machine's count back


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_agrees_with_float_kv(reference, kv):
    """Free-running greedy text drifts apart after the first near-tie on this small model (fp32 against a bf16
    model agrees on ~56% of positions), so agreement is measured teacher-forced: the same sequences fed to both,
    the greedy token compared at every position (1,1xx positions)."""
    seqs, expected = reference
    llm = _llm(kv_cache_dtype=kv)
    runner = llm.llm_engine.core.runner
    assert runner.kv_caches[0][0].dtype == {"fp8": FP8, "int8": torch.int8}[kv]
    assert runner.kv_scales is not None and runner.kv_scales.shape == (8, 2, 2) and (runner.kv_scales > 0).all()
    got = _argmaxes(llm, seqs)
    total = sum(len(r) for r in expected)
    agree = sum(a == b for r, q in zip(expected, got) for a, b in zip(r, q)) / total
    assert agree >= 0.95, f"{kv}: teacher-forced greedy agreement {agree:.4f} over {total} positions"


def test_capacity_doubles_against_bf16():
    """Same memory budget: an fp8 or int8 cache holds twice the blocks of a bf16 one (counting the spare block;
    +1 where half a bf16 block's bytes were left over)."""
    blocks = {kv: LLM(str(DEMO_MODEL_DIR), device="cpu", dtype="bfloat16", kv_cache_memory_gib=0.01,
                      kv_cache_dtype=kv).llm_engine.core.num_blocks for kv in ("auto", "fp8", "int8")}
    assert blocks["fp8"] == blocks["int8"], blocks
    assert blocks["fp8"] + 1 - 2 * (blocks["auto"] + 1) in (0, 1), blocks


def test_kv_cache_dtype_errors(monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4': use one of auto, fp8, int8"):
        CacheConfig(kv_cache_dtype="fp4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.9.*use kv_cache_dtype='int8'"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda"), kernels=True)
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, torch.device("cuda"), kernels=True) == torch.int8
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu"), kernels=False) == torch.bfloat16
    with pytest.raises(ValueError, match="needs head_dim divisible by 4.*this model's is 6"):
        resolve_kv_cache_dtype("int8", torch.bfloat16, torch.device("cuda"), kernels=True, head_dim=6)
    # the torch path (CPU) reads any head_dim
    assert resolve_kv_cache_dtype("int8", torch.float32, torch.device("cpu"), kernels=False, head_dim=6) == torch.int8


def test_cli_flag_reaches_the_engine_config():
    from strataserve.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", str(DEMO_MODEL_DIR), "--kv-cache-dtype", "int8"])
    assert engine_config(args, str(DEMO_MODEL_DIR)).cache.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", str(DEMO_MODEL_DIR), "--kv-cache-dtype", "fp4"])
