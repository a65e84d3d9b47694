"""End-to-end greedy equivalence with HF transformers (issue 2's acceptance test).

For every decoder family, a tiny random float32 checkpoint is generated with ``save_pretrained``; HF ``generate()``
(one prompt at a time, so no padding is involved) is the independent reference. Our engine runs all prompts in
one continuous batch, then again with shared prefixes (prefix-cache hits), a tiny token budget (chunked prefill)
and a KV pool too small for the batch (preemption). Every run must be token-identical to HF.
"""
from __future__ import annotations

import random

import pytest
import torch

from _tiny_models import FAMILIES, hf_greedy, load_hf_model, make_tiny_checkpoint
from strataserve import LLM, SamplingParams

MAX_NEW = 12
FAMILIES_UNDER_TEST = [f for f in FAMILIES if f != "llama"] + ["llama"]


def _prompts(seed: int, n: int, vocab: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(5, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model, prompts, MAX_NEW)


def _ours(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=FAMILIES_UNDER_TEST)
def family_ckpt(request, tmp_path_factory):
    family = request.param
    path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family))
    return family, path, load_hf_model(path)


def test_greedy_matches_hf_in_every_scheduling_regime(family_ckpt):
    family, path, hf = family_ckpt
    vocab = hf.config.vocab_size
    prompts = _prompts(1, 10, vocab)
    shared = _prompts(2, 8, vocab, shared_prefix=37)  # 2 full blocks + a partial one shared
    expected = _hf_greedy(hf, prompts + shared)

    # Plain continuous batching, then shared prefixes: the second wave must hit the prefix cache.
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_blocks=256, max_num_seqs=16)
    assert _ours(llm, prompts) == expected[:10], family
    assert _ours(llm, shared[:1]) == expected[10:11]
    hits_before = llm.llm_engine.stats.prefix_cache_hits
    assert _ours(llm, shared[1:]) == expected[11:]
    assert llm.llm_engine.stats.prefix_cache_hits - hits_before >= 7 * 32, "shared prefixes did not hit the cache"

    # A tiny token budget forces prompts to be prefilled in chunks mixed with other requests' decodes.
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_blocks=256, max_num_batched_tokens=8,
              max_num_seqs=8, enable_prefix_caching=False)
    assert _ours(llm, prompts + shared) == expected, family

    # A pool that cannot hold every sequence at once forces preemption by recompute.
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_blocks=12, block_size=16, max_num_seqs=18,
              enable_prefix_caching=False)
    assert _ours(llm, prompts + shared) == expected, family
    assert llm.llm_engine.stats.num_preemptions > 0, "the small pool did not preempt anything"
    assert llm.llm_engine.stats.num_free_blocks == llm.llm_engine.stats.num_total_blocks


def test_chosen_token_logprobs_match_hf_log_softmax(family_ckpt):
    family, path, hf = family_ckpt
    prompts = _prompts(3, 4, hf.config.vocab_size)
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_blocks=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        comp = out.outputs[0]
        full = torch.tensor([p + list(comp.token_ids)])
        with torch.inference_mode():
            ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            want = ref[len(p) - 1 + i]
            assert abs(lp[tok].logprob - want[tok].item()) < 1e-4, (family, i)
            top = torch.topk(want, 3).indices.tolist()
            assert set(top) <= set(lp), (family, i, top, sorted(lp))


def test_logit_bias_greedy_matches_hf_sequence_bias(family_ckpt):
    """OpenAI's logit_bias against HF's ``sequence_bias`` (single-token sequences: a constant added to the logit)."""
    family, path, hf = family_ckpt
    prompts = _prompts(4, 5, hf.config.vocab_size)
    plain = _hf_greedy(hf, prompts)
    # ban the first token every unbiased continuation picked, and favour two others a little
    bias = {t: -100.0 for t in {p[0] for p in plain}} | {11: 1.5, 12: 0.75}
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                              sequence_bias={(t,): b for t, b in bias.items()})
            want.append(gen[0, len(p):].tolist())
    assert want != plain and not {t for w in want for t in w} & {p[0] for p in plain}
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                            logit_bias={str(t): b for t, b in bias.items()})
    got = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want, family


def test_long_prompts_through_the_prompt_tiles_match_hf(family_ckpt):
    """Prompts of 140-290 tokens: on CPU with torch's MKL their attention runs as tiles of sgemm
    (runner/cpu_attention_gemm.h), whole and, with a 160-token budget, as a 130-row chunk after 160 cached tokens.
    Greedy tokens equal HF's and the chosen tokens' logprobs match its log-softmax."""
    family, path, hf = family_ckpt
    rng = random.Random(5)
    prompts = [[rng.randrange(5, hf.config.vocab_size) for _ in range(n)] for n in (140, 200, 290)]
    expected = _hf_greedy(hf, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    for budget in (2048, 160):
        llm = LLM(model=str(path), dtype="float32", device="cpu", num_blocks=128, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected, (family, budget)
        for p, out in zip(prompts, outs):
            comp = out.outputs[0]
            with torch.inference_mode():
                ref = torch.log_softmax(hf(torch.tensor([p + list(comp.token_ids)])).logits[0].float(), dim=-1)
            for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
                assert abs(lp[tok].logprob - ref[len(p) - 1 + i][tok].item()) < 1e-4, (family, budget, i)
