"""The one-read log-prob statistics kernel (``kernels/token_logprobs.py``) against log_softmax + gather + rank count
+ argmax, and the sampler's logprobs through it (``token_logprobs_deferred(path="kernel")``) against the torch path."""
from __future__ import annotations

import warnings

import pytest
import torch

from strataserve.kernels.token_logprobs import row_logprob_stats, row_logprob_stats_ref
from strataserve.runner.sampler import resolve_logprobs, token_logprobs_deferred

from ._helpers import noncontig

INF, NAN = float("inf"), float("nan")


@pytest.fixture(autouse=True)
def _quiet_interpreter():
    """The interpreter runs the kernels through numpy, which warns on -inf - -inf and log2(0) (handled in-kernel)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _check(x: torch.Tensor, chosen: torch.Tensor, block: int = 128, rtol: float = 0.0, top_n: int = 1) -> None:
    got = row_logprob_stats(x, chosen, block=block, top_n=top_n)
    want = row_logprob_stats_ref(x, chosen, top_n)
    for name, g, w in zip(("lse", "chosen_lp", "rank", "top_ids", "top_lps"), got, want):
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=rtol, equal_nan=True, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("R", [1, 3, 17])
@pytest.mark.parametrize("V,block", [(1000, 128), (5003, 1024), (5003, 4096), (64, 16)])
@pytest.mark.parametrize("pick", ["argmax", "random"])
def test_stats_match_log_softmax(device, R, V, block, pick):
    """V not a multiple of the chunk (a ragged last chunk), chosen = the argmax (rank 1) or random ids."""
    x = torch.randn(R, V, device=device) * 4
    chosen = x.argmax(dim=-1) if pick == "argmax" else torch.randint(0, V, (R,), device=device)
    _check(x, chosen, block)
    if pick == "argmax":
        assert row_logprob_stats(x, chosen, block=block)[2].eq(1).all()


@pytest.mark.parametrize("top_n", [2, 5, 8, 13, 20, 32])
@pytest.mark.parametrize("V,block", [(1000, 128), (5003, 1024), (70, 16)])
def test_top_n_matches_topk(device, top_n, V, block):
    """The top n from the chunks' candidates: torch.topk's ids and log-probs, n not a multiple of the bucket (4),
    chunks shorter than n (V = 70 in chunks of 16; a ragged last chunk of 6 or 8), the top n all in one chunk."""
    x = torch.randn(3, V, device=device) * 4
    x[2, 20:20 + top_n] += 100.0  # row 2: the whole top n inside one or two chunks
    _check(x, torch.randint(0, V, (3,), device=device), block, top_n=top_n)


def test_top_n_with_inf_entries_and_short_rows(device):
    """Fewer finite values than n: the -inf ones follow, by index (torch.topk's order among ties is unspecified);
    n = V takes every entry once."""
    x = torch.full((2, 40), -INF, device=device)
    x[0, [3, 17, 33]] = torch.tensor([1.0, 3.0, 2.0], device=device)
    x[1] = torch.randn(40, device=device)
    ids, lps = row_logprob_stats(x, torch.tensor([3, 0], device=device), top_n=6, block=16)[3:]
    assert ids[0].tolist() == [17, 33, 3, 0, 1, 2]
    assert torch.isfinite(lps[0, :3]).all() and lps[0, 3:].eq(-INF).all()
    ids, lps = row_logprob_stats(x, torch.tensor([3, 0], device=device), top_n=32, block=16)[3:]
    _check(x[1:2, :32], torch.tensor([0], device=device), block=16, top_n=32)
    assert len(set(ids[1].tolist())) == 32


def test_strided_rows_are_read_in_place(device):
    """A view with a padded row stride (a graph's logits buffer) and every other row of a bigger tensor."""
    big = torch.randn(10, 1003, device=device) * 4
    for x in (big[::2], noncontig(big[:4, :1000]), big[1:4, 3:900]):
        _check(x, torch.randint(0, x.shape[1], (x.shape[0],), device=device), block=256)


def test_large_magnitudes_need_the_online_max(device):
    """x * 50: chunk maxima hundreds apart, so each chunk's sum must be rescaled to the row max (a fixed reference
    would overflow exp); the max may sit in any chunk, the last one included."""
    x = torch.randn(5, 3000, device=device) * 4 * 50
    x[1, 2990] = 2000.0  # the row max in the ragged last chunk
    x[2, 0] = 2000.0
    x[3] -= 1e4  # every value far below 0
    chosen = torch.randint(0, 3000, (5,), device=device)
    chosen[4] = x[4].argmax()
    _check(x, chosen, block=256, rtol=1e-6)  # (log-probs near -1000: one float32 ulp is 6e-5)


def test_inf_entries(device):
    """-inf entries (banned tokens, a grammar mask) drop out of the sum; a chosen -inf has log-prob -inf and rank
    1 + the number of finite entries; a chunk of only -inf is skipped."""
    x = torch.randn(4, 700, device=device) * 4
    x[:, ::3] = -INF
    x[1, 128:256] = -INF  # one whole chunk of 128
    chosen = torch.tensor([3, 9, 1, 4], device=device)  # rows 0, 1: -inf tokens
    _check(x, chosen)
    lp, rank = row_logprob_stats(x, chosen, block=128)[1:3]
    assert lp[0].item() == -INF and rank[0].item() == int(torch.isfinite(x[0]).sum()) + 1


def test_nan_and_degenerate_rows(device):
    """Rows with a NaN, a +inf, or all -inf: NaN log-probs and rank 1 (torch's log_softmax is NaN across such a row
    and NaN compares false); top-1 = torch.argmax; lse = torch.logsumexp (NaN, +inf, -inf). A chosen id out of
    range: NaN log-prob, rank 1. The other rows are unaffected."""
    x = torch.randn(6, 300, device=device) * 4
    x[0, 200] = NAN
    x[0, 250] = NAN
    x[1, 130] = INF
    x[2] = -INF
    chosen = torch.tensor([5, 7, 3, 2, 300, -1], device=device)
    lse, lp, rank, tid, tlp = row_logprob_stats(x, chosen, block=64)
    assert tid[:3, 0].tolist() == [200, 130, 0] and torch.equal(tid[:, 0], x.argmax(dim=-1))
    assert torch.isnan(lse[0]) and lse[1].item() == INF and lse[2].item() == -INF
    assert torch.isnan(lp[[0, 1, 2, 4, 5]]).all() and torch.isnan(tlp[:3]).all()
    tid4, tlp4 = row_logprob_stats(x, chosen, block=64, top_n=4)[3:]
    assert torch.isnan(tlp4[:3]).all() and tid4[1, 0].item() == 130 and tid4[2].tolist() == [0, 1, 2, 3]
    assert 200 not in tid4[0].tolist() and torch.equal(tid4[3:], x[3:].topk(4, dim=-1).indices)
    assert rank[[0, 1, 2, 4, 5]].tolist() == [1] * 5
    _check(x[:4], chosen[:4], block=64)  # the reference agrees on rows 0-3
    ref = torch.log_softmax(x[3], dim=-1)
    assert abs(lp[3].item() - ref[2].item()) < 1e-5 and torch.isfinite(tlp[3:]).all()


def test_rows_subset_without_a_copy(device):
    x = torch.randn(7, 1500, device=device) * 4
    rows = torch.tensor([6, 0, 3], device=device)
    chosen = torch.randint(0, 1500, (3,), device=device)
    for top_n in (1, 6):
        got = row_logprob_stats(x, chosen, rows=rows.to(torch.int32), block=256, top_n=top_n)
        want = row_logprob_stats(x[rows], chosen, block=256, top_n=top_n)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_bad_inputs(device):
    x = torch.randn(2, 8, device=device)
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"expected \[B, V\]"):
        row_logprob_stats(torch.randn(8, device=device), ids)
    with pytest.raises(ValueError, match="dtype torch.int64 not supported"):
        row_logprob_stats(x.long(), ids)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        row_logprob_stats(torch.randn(8, 2, device=device).t(), ids)
    with pytest.raises(ValueError, match="chosen: dtype torch.float32 not supported"):
        row_logprob_stats(x, ids.float())
    with pytest.raises(ValueError, match="chosen: expected 2 ids"):
        row_logprob_stats(x, ids[:1])
    with pytest.raises(ValueError, match="rows: expected the shape of chosen"):
        row_logprob_stats(x, ids, rows=ids[:1])
    with pytest.raises(ValueError, match="power of two"):
        row_logprob_stats(x, ids, block=48)
    with pytest.raises(ValueError, match=r"top_n: expected 1..8, got 9"):
        row_logprob_stats(x, ids, top_n=9)
    with pytest.raises(ValueError, match=r"top_n: expected 1..32, got 0"):
        row_logprob_stats(torch.randn(2, 100, device=device), ids, top_n=0)
    out = row_logprob_stats(x[:0], ids[:0], top_n=3)
    assert [tuple(t.shape) for t in out] == [(0,), (0,), (0,), (0, 3), (0, 3)]


# ----------------------------------------------------------------------------- the sampler's logprobs
def _same(a, b) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert (a.token_id, a.rank, a.top_token_ids) == (b.token_id, b.rank, b.top_token_ids)
    assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)


@pytest.mark.parametrize("top_ns", [[None, 0, 1, 5, None], [1, 1, None], [0, 3], [2, None, 0, 20, 1]])
@pytest.mark.parametrize("pick", ["argmax", "random"])
def test_deferred_kernel_path_matches_torch_path(device, top_ns, pick):
    """Mixed requests in one step: no logprobs, the chosen token only, top-1, top-n up to MAX_LOGPROBS; a subset of
    the rows or all of them."""
    x = torch.randn(len(top_ns), 5003, device=device) * 4
    tokens = x.argmax(dim=-1) if pick == "argmax" else torch.randint(0, 5003, (len(top_ns),), device=device)
    got = resolve_logprobs(token_logprobs_deferred(x, tokens, top_ns, path="kernel"))
    want = resolve_logprobs(token_logprobs_deferred(x, tokens, top_ns, path="torch"))
    assert len(got) == len(want) == len(top_ns)
    for a, b in zip(got, want):
        _same(a, b)
    assert [len(a.top_token_ids) if a else None for a in got] == [n or 0 if n is not None else None for n in top_ns]


def test_deferred_nan_row_matches_torch_path(device):
    x = torch.randn(3, 400, device=device) * 4
    x[1, 50] = NAN
    tokens = torch.tensor([4, 50, 8], device=device)
    got = resolve_logprobs(token_logprobs_deferred(x, tokens, [1, 1, 3], path="kernel"))
    want = resolve_logprobs(token_logprobs_deferred(x, tokens, [1, 1, 3], path="torch"))
    assert got[1].rank == want[1].rank == 1 and got[1].logprob != got[1].logprob  # NaN
    assert got[1].top_logprobs[0] != got[1].top_logprobs[0] and want[1].top_logprobs[0] != want[1].top_logprobs[0]
    _same(got[0], want[0])
    _same(got[2], want[2])


def test_deferred_path_choice(monkeypatch, device):
    """CPU tensors take the torch path unless asked, whatever STRATA_LOGPROBS says (CPU results do not change);
    path="kernel" runs the kernel; an unknown path is a ValueError."""
    import strataserve.kernels.token_logprobs as mod
    from strataserve import envs

    calls = []
    real = mod.row_logprob_stats
    monkeypatch.setattr(mod, "row_logprob_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(envs, "STRATA_LOGPROBS", "kernel")
    x = torch.randn(2, 50)
    tokens = x.argmax(dim=-1)
    default = token_logprobs_deferred(x, tokens, [2, 2])
    torch_path = token_logprobs_deferred(x, tokens, [2, 2], path="torch")
    assert not calls
    assert torch.equal(default.top_lps, torch_path.top_lps) and torch.equal(default.chosen_lp, torch_path.chosen_lp)
    x = x.to(device)
    token_logprobs_deferred(x, x.argmax(dim=-1), [2, 2], path="kernel")
    assert calls == [1]
    if device != "cpu":  # the default on a GPU: the kernel, or the torch path for a layout it does not read
        token_logprobs_deferred(x, x.argmax(dim=-1), [2, 2])
        assert calls == [1, 1]
        xt = torch.randn(50, 2, device=device).t()
        assert token_logprobs_deferred(xt, xt.argmax(dim=-1), [2, 2]).ranks.tolist() == [1, 1] and len(calls) == 2
    assert token_logprobs_deferred(x, tokens, [None, None], path="kernel") == [None, None]
    with pytest.raises(ValueError, match="path: expected one of"):
        token_logprobs_deferred(x, tokens, [1, 1], path="triton")


def test_the_kernel_covers_every_top_n_a_request_may_ask():
    from strataserve.kernels.token_logprobs import MAX_TOP_N
    from strataserve.types.sampling import MAX_LOGPROBS

    assert MAX_TOP_N >= MAX_LOGPROBS
