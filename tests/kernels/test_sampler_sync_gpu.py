"""The sampler queues every request kind's work without waiting for the device (GPU only: conftest.py leaves this
file out of CPU runs). Under ``torch.cuda.set_sync_debug_mode("error")`` any host sync raises, so a step with
seeds, top-k/top-p/min-p, penalties from the device's token history, min_tokens, bad words, logit bias, allowed ids, logprobs
and a grammar mask would fail here if one crept back in; and its tokens equal the CPU sampler's."""
from __future__ import annotations

import pytest
import torch

from strataserve.runner.logits_mask import apply_token_bitmask
from strataserve.runner.sampler import Sampler, SamplingRequest, resolve_logprobs
from strataserve.runner.token_history import TokenHistory
from strataserve.types.sampling import SamplingParams as SP

V = 4096


def _reqs() -> list[SamplingRequest]:
    kinds = [
        SP(temperature=0.8, top_p=0.9, seed=1), SP(temperature=1.0, top_k=40, seed=2),
        SP(temperature=0.7, min_p=0.1, seed=3, logprobs=4), SP(temperature=0.0, logprobs=0),
        SP(temperature=0.6, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, seed=4),
        SP(temperature=0.0, min_tokens=8, stop_token_ids=[5, 6]), SP(temperature=0.9, bad_words_token_ids=[[7]],
                                                                      seed=5, top_k=100, top_p=0.8),
        SP(temperature=0.0, logit_bias={9: 5.0}), SP(temperature=1.2, allowed_token_ids=list(range(100, 400)), seed=6),
        SP(temperature=0.0, repetition_penalty=1.5),
    ]
    g = torch.Generator().manual_seed(0)
    return [SamplingRequest(p, torch.randint(0, V, (20,), generator=g).tolist(),
                            torch.randint(0, V, (i,), generator=g).tolist(), eos_token_id=2)
            for i, p in enumerate(kinds)]


def test_sampling_never_syncs_and_matches_the_cpu_sampler():
    reqs = _reqs()
    x = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(1)) * 3
    bitmask = torch.full((1, V // 32), -1, dtype=torch.int32)
    bitmask[0, :8] = 0  # the grammar row forbids the first 256 ids
    dev = torch.device("cuda")
    xd = x.to(dev)
    history = TokenHistory(V, dev)
    pen = [r for r in reqs if r.params.uses_penalties]
    history.rows(pen)  # the rows are built from the host lists before the step (at the request's first sample)
    pending = torch.tensor([11, 12], device=dev)  # then a step samples these, still on the device
    history.record(pen, pending)
    for r in pen:
        r.num_sampled = len(r.output_token_ids) + 1
    apply_token_bitmask(torch.zeros(1, V, device=dev), [0], bitmask)  # the unpack table is made once, not timed
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_token_bitmask(xd, [3], bitmask)
        tokens, lps = Sampler().sample(xd, reqs, history)
        history.record(reqs, tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # the CPU reference: the same rows with the in-flight tokens already in the host lists
    extra = {id(r): t for r, t in zip(pen, [11, 12])}
    ref_reqs = [SamplingRequest(r.params, r.prompt_token_ids, r.output_token_ids + ([extra[id(r)]] if id(r) in extra
                                                                                      else []), 2) for r in reqs]
    xc = x.clone()
    apply_token_bitmask(xc, [3], bitmask)
    want, want_lps = Sampler()(xc, ref_reqs)
    got = tokens.tolist()
    greedy_or_seeded = [i for i, r in enumerate(reqs) if r.params.greedy or r.params.seed is not None]
    assert len(greedy_or_seeded) >= 8
    assert [got[i] for i in greedy_or_seeded] == [want[i] for i in greedy_or_seeded]
    for a, b in zip(resolve_logprobs(lps), want_lps):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and a.rank == b.rank
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("path", ["kernel", "sort"])
def test_top_p_paths_never_sync_and_agree(path):
    """Both accelerator top-p paths (``STRATA_TOP_P``) queue their work without a host sync at the Qwen3 vocabulary,
    with temperature, min-p and top-k in the same step; their kept tokens agree (boundary rows aside)."""
    from strataserve.runner.sampling_filters import filtered_logits

    from .test_top_p import _boundary_rows

    vocab, g = 151_936, torch.Generator().manual_seed(2)
    params = [SP(temperature=t, top_p=p, top_k=k, min_p=m) for t in (0.6, 1.0) for p in (0.5, 0.95, 0.999)
              for k, m in ((0, 0.0), (50, 0.0), (0, 0.05))] + [SP(temperature=0.8, top_k=20)]
    x = (torch.randn(len(params), vocab, generator=g) * 3).cuda()
    filtered_logits(x, params, path)  # compiled / allocated before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = filtered_logits(x, params, path)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    other = filtered_logits(x, params, "sort" if path == "kernel" else "kernel")
    differ = (torch.isfinite(got) != torch.isfinite(other)).any(dim=-1)
    if differ.any():
        pre = filtered_logits(x, [SP(temperature=q.temperature, top_k=q.top_k, min_p=q.min_p) for q in params])
        low = [torch.where(torch.isfinite(y), y, float("inf")).amin(dim=-1, keepdim=True) for y in (got, other)]
        p = torch.tensor([q.top_p for q in params], device="cuda")
        assert (~differ | _boundary_rows(pre, *low, p)).all()  # (a few rows at p 0.999 at this vocabulary)
    assert torch.isfinite(got[-1]).sum().item() == 20
