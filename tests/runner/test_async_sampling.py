"""Everything the sampler reads from a request's past (seeded draws, min_tokens, penalties, bad words, logprobs)
gives the same tokens and logprobs under async scheduling, where step N+1 is sampled before step N's token has
reached the host, as in a synchronous run; and such requests keep the steps going out ahead."""
from __future__ import annotations

import random

import pytest
import torch

from _tiny_models import make_tiny_checkpoint
from strataserve.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from strataserve.engine.engine_core import EngineCore
from strataserve.runner.model_runner import ModelRunner
from strataserve.runner.penalties import apply_penalties, apply_penalties_counts
from strataserve.runner.sampler import SamplingRequest
from strataserve.runner.token_history import TokenHistory
from strataserve.types.protocol import EngineCoreRequest
from strataserve.types.sampling import SamplingParams
from strataserve.types.sampling import SamplingParams as SP

MAX_NEW = 14


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), vocab_size=300, tokenizer=False)


def run(path, requests: dict[str, tuple[list[int], SamplingParams]], async_scheduling: bool, budget: int = 32,
        num_blocks: int = 128):
    cfg = EngineConfig(ModelConfig(model=str(path), dtype="float32", device="cpu"),
                       CacheConfig(block_size=4, num_blocks=num_blocks),
                       SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget), RunnerConfig(mode="eager"))
    core = EngineCore(cfg, runner=ModelRunner(cfg, async_scheduling=async_scheduling))
    for rid, (prompt, sp) in requests.items():
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp))
    toks: dict[str, list[int]] = {rid: [] for rid in requests}
    lps: dict[str, list] = {rid: [] for rid in requests}
    ahead = 0
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            toks[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend(o.new_logprobs or [])
        ahead += core.has_step_in_flight()
    run.preemptions = core.stats().num_preemptions
    history = core.runner.token_history
    if history is not None:  # no orphan rows: each one in use belongs to a request the runner still holds
        assert history.rows_in_use == sum(r.history_slot >= 0 for r in core.runner.requests.values())
    core.shutdown()
    return toks, lps, ahead


def mixed_requests(rng: random.Random) -> dict[str, tuple[list[int], SamplingParams]]:
    def prompt():
        return [rng.randrange(5, 300) for _ in range(rng.randint(3, 20))]
    kinds = [
        dict(temperature=0.0, repetition_penalty=1.8),
        dict(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.7),
        dict(temperature=0.9, top_p=0.8, seed=11, repetition_penalty=1.3, frequency_penalty=0.4),
        dict(temperature=1.0, top_k=20, seed=12),
        dict(temperature=0.7, min_p=0.05, seed=13, logprobs=3),
        dict(temperature=0.0, logprobs=2),
        dict(temperature=1.2, seed=14, min_tokens=6, stop_token_ids=[7, 9, 11, 13]),
        dict(temperature=0.0, bad_words_token_ids=[[17], [19]], logit_bias={23: 3.0}),
        dict(temperature=0.8, seed=15, allowed_token_ids=list(range(40, 90)), presence_penalty=1.0),
    ]
    return {f"r{i}": (prompt(), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **k)) for i, k in enumerate(kinds)}


@pytest.mark.parametrize("num_blocks", [128, 40])  # 40: requests are preempted and recomputed mid-flight
def test_async_sampling_matches_the_synchronous_run_token_for_token(ckpt, num_blocks):
    reqs = mixed_requests(random.Random(3))
    sync_toks, sync_lps, _ = run(ckpt, reqs, async_scheduling=False, num_blocks=num_blocks)
    got_toks, got_lps, ahead = run(ckpt, reqs, async_scheduling=True, num_blocks=num_blocks)
    assert ahead > 0  # the steps really went out before the previous tokens were known
    assert (run.preemptions > 0) == (num_blocks < 128)
    assert got_toks == sync_toks
    for rid in reqs:
        assert len(got_lps[rid]) == len(sync_lps[rid])
        for a, b in zip(got_lps[rid], sync_lps[rid]):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.token_id == b.token_id and a.rank == b.rank and a.top_token_ids == b.top_token_ids
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    # the penalties really acted: without them the greedy rows come out differently
    plain = {rid: (p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0))
             for rid, (p, _) in list(reqs.items())[:2]}
    unpenalised, _, _ = run(ckpt, plain, async_scheduling=True)
    assert all(unpenalised[rid] != sync_toks[rid] for rid in plain)


def test_a_longer_bad_word_is_banned_under_async_scheduling(ckpt):
    """The head of a two-token bad word is the token still in flight: the engine keeps such a request
    synchronous, so its ban is never a step late (it was, before)."""
    prompt = [5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0)
    base, _, _ = run(ckpt, {"a": (prompt, greedy)}, async_scheduling=False)
    word = base["a"][2:4]
    sp = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0, bad_words_token_ids=[word])
    want, _, _ = run(ckpt, {"a": (prompt, sp)}, async_scheduling=False)
    got, _, _ = run(ckpt, {"a": (prompt, sp)}, async_scheduling=True)
    assert got == want
    out = got["a"]
    assert not any(out[i:i + 2] == word for i in range(len(out) - 1))


def test_device_token_history_penalises_as_the_host_lists_do():
    """Rows built from the host lists, then tokens recorded on the device (one still in flight, never appended to
    the host list), rows freed and reused: the penalised logits equal the sparse host path's over the full lists."""
    g = torch.Generator().manual_seed(0)
    vocab, rows = 50, 6
    rng = random.Random(0)
    prompts = [[rng.randrange(-2, vocab + 3) for _ in range(rng.randint(0, 12))] for _ in range(rows)]
    outs = [[rng.randrange(0, vocab) for _ in range(rng.randint(0, 15))] for _ in range(rows)]
    rep = [1.0, 1.5, 0.7, 1.2, 1.0, 2.0]
    freq = [0.0, 0.5, -0.3, 1.0, 0.2, 0.0]
    pres = [0.0, 1.0, 0.4, -0.5, 0.0, 0.3]
    history = TokenHistory(vocab, torch.device("cpu"), capacity=2)  # grows twice on the way
    stale = SamplingRequest(SP(repetition_penalty=1.1), [1, 2], [3])
    history.rows([stale])
    history.release(stale)  # its row is reused, and must come back clean
    reqs = [SamplingRequest(SP(), p, list(o)) for p, o in zip(prompts, outs)]
    for step in range(3):
        x = torch.randn(rows, vocab, generator=g) * 3
        want = x.clone()
        apply_penalties(want, prompts, outs, rep, freq, pres)
        got = x.clone()
        apply_penalties_counts(got, *history.rows(reqs), rep, freq, pres)
        torch.testing.assert_close(got, want)
        assert not torch.equal(got, x)
        sampled = torch.tensor([rng.randrange(0, vocab) for _ in range(rows)])
        history.record(reqs, sampled)  # on the device only: the host lists stay one behind, as in flight
        for o, t in zip(outs, sampled.tolist()):
            o.append(t)
    assert history.rows_in_use == rows
    for r in reqs:
        history.release(r)
    assert history.rows_in_use == 0
