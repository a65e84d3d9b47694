"""The sampler's logit filters (temperature, min-p, top-k, top-p; vLLM's order) and the host -> device lists they
need, all without a host sync on an accelerator.

Why sync-free: under async scheduling the runner queues step N+1's sampling while step N's host work runs; any
blocking copy or any Python branch on a device value (``bool(t.any())``, ``t.numel()`` of a masked tensor,
``torch.tensor(list, device="cuda")``, which copies and then waits for the stream) stalls the host until the
forward pass is done and the overlap is lost. So per-row parameters travel as one non-blocking copy each, and on
accelerators the top-p cut-off is searched for inside one kernel per step without sorting
(``STRATA_TOP_P=kernel``, the default, ``kernels/top_p.py``) or comes from a full sort of every row
(``STRATA_TOP_P=sort``), where the CPU path's candidate search would have to ask the device how many rows it
resolved.
"""
from __future__ import annotations

from typing import Sequence

import torch

from strataserve import envs
from strataserve.types.sampling import SamplingParams

#: how ``filtered_logits`` finds top-p cut-offs: the CPU's candidate search, a full sort, or the sort-free kernel
TOP_P_PATHS = ("search", "sort", "kernel")


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype, device)`` without the stream sync of a blocking host -> device copy (pageable
    memory is staged by the driver at once, so the list may go away)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def filtered_logits(x: torch.Tensor, params: Sequence[SamplingParams], top_p_path: str | bool | None = None
                    ) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p applied to (penalised) logits [R, V] of non-greedy rows; -inf = dropped.

    Returns a new tensor; ``softmax`` of it is the distribution the row samples from. ``top_p_path``: one of
    ``TOP_P_PATHS`` (True = "sort", False = "search"); None: "search" on CPU, else ``STRATA_TOP_P`` (both
    accelerator paths are sync-free)."""
    vocab = x.shape[1]
    dev = x.device
    temps = [p.temperature for p in params]
    x = x / to_device(temps, torch.float32, dev).unsqueeze(1) if any(t != 1.0 for t in temps) else x.clone()
    if any(p.min_p > 0.0 for p in params):
        _min_p(x, to_device([p.min_p for p in params], torch.float32, dev))
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(p.top_p < 1.0 for p in params):
        path = _top_p_path(top_p_path, dev)
        ps = [p.top_p for p in params]
        if path == "kernel":
            _top_k_top_p_kernel(x, ks, ps)
        else:
            (_top_k_top_p_sorted if path == "sort" else _top_k_top_p)(x, ks, ps)
    elif any(k < vocab for k in ks):
        _top_k(x, to_device(ks, torch.int64, dev), max(k for k in ks if k < vocab))
    return x


def _top_p_path(path: str | bool | None, dev: torch.device) -> str:
    if path is None:
        return "search" if dev.type == "cpu" else envs.STRATA_TOP_P
    if isinstance(path, bool):
        return "sort" if path else "search"
    if path not in TOP_P_PATHS:
        raise ValueError(f"top_p_path: expected one of {TOP_P_PATHS}, got {path!r}")
    return path


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """p[t] < min_p * p_max  <=>  x[t] < x_max + log(min_p); done in logit space, no softmax needed."""
    thresh = x.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    x.masked_fill_(x < thresh, float("-inf"))


def _top_k(x: torch.Tensor, k: torch.Tensor, k_max: int) -> None:
    """Keep logits >= the row's k-th largest; ``k`` holds vocab_size for rows without top-k."""
    kth = x.topk(k_max, dim=-1).values.gather(1, (k.clamp(max=k_max) - 1).unsqueeze(1))
    kth.masked_fill_((k > k_max).unsqueeze(1), float("-inf"))
    x.masked_fill_(x < kth, float("-inf"))


def _cutoff(vals: torch.Tensor, lse: torch.Tensor, k: torch.Tensor, p: torch.Tensor, vocab: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Over each row's largest logits ``vals`` (sorted, descending): (the smallest kept logit, whether the cut-off
    is known from these candidates alone). ``k``/``p`` [R, 1]; k = vocab means no top-k."""
    n = vals.shape[1]
    has_k = k < vocab
    kth = vals.gather(1, k.clamp(max=n) - 1)
    in_k = ~has_k | (vals >= kth)  # when k > n every candidate is >= the clamped kth
    probs = torch.where(in_k, (vals - lse).exp(), 0.0)
    # top-p acts on the top-k renormalised distribution: mass Z (1 without top-k; known once k <= n)
    z = torch.where(has_k, probs.sum(dim=-1, keepdim=True), 1.0)
    mass_before = probs.cumsum(dim=-1) - probs
    # a prefix; the first candidate always stays (p > 0). p >= 1 is no top-p at all (as in the kernel): the rounded
    # cumsum could otherwise drop a top-k row's tiniest tail only when a batch-mate's top_p routes it through here,
    # which made the row's distribution depend on its batch
    keep = in_k & ((mass_before < p * z) | (p >= 1.0))
    # Resolved when the cut-off falls inside the candidates (and the top-k mass Z was fully seen).
    done = (~keep[:, -1] & (~has_k[:, 0] | (k[:, 0] <= n))) if n < vocab else torch.ones_like(keep[:, 0])
    return vals.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True), done


def _top_k_top_p_sorted(x: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    """Top-k then top-p, in place, from one full sort of every row: no data-dependent step, so nothing waits for
    the device (vLLM's native path does the same)."""
    dev = x.device
    k = to_device(ks, torch.int64, dev).unsqueeze(1)
    p = to_device(ps, torch.float32, dev).unsqueeze(1)
    vals = x.sort(dim=-1, descending=True).values
    cut, _ = _cutoff(vals, x.logsumexp(dim=-1, keepdim=True), k, p, x.shape[1])
    x.masked_fill_(x < cut, float("-inf"))


def _top_k_top_p_kernel(x: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    """Top-k, then top-p from each row's cut-off found without a sort (``kernels/top_p.py``): the rows' top-k
    masks first, so the kernel's softmax is already the top-k renormalised distribution. Sync-free as the sort."""
    from strataserve.kernels.top_p import top_p_cutoff  # (imports triton: only where this path runs)

    if x.dtype != torch.float32:  # (the sampler's logits are float32) the kernel reads float32 only
        _top_k_top_p_sorted(x, ks, ps)
        return
    vocab = x.shape[1]
    dev = x.device
    if any(k < vocab for k in ks):
        _top_k(x, to_device(ks, torch.int64, dev), max(k for k in ks if k < vocab))
    cut = top_p_cutoff(x, to_device(ps, torch.float32, dev))
    x.masked_fill_(x < cut, float("-inf"))


def _top_k_top_p(x: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    """Top-k then top-p, in place, keeping logits >= each row's cut-off (ties at the cut-off are kept).

    ``ks[i]`` is the vocabulary size for rows without top-k. A full vocabulary sort is slow (45 ms for 200 x 4096
    on one CPU core, far more for 150k vocabularies), yet the nucleus is usually small: look for the cut-off among
    the top 64 (then 1024 for large vocabularies) candidates, and sort only the rows whose cut-off lies further.
    """
    num_rows, vocab = x.shape
    dev = x.device
    active = [i for i in range(num_rows) if ks[i] < vocab or ps[i] < 1.0]
    rows = torch.tensor(active, device=dev)
    k = torch.tensor([ks[i] for i in active], dtype=torch.int64, device=dev).unsqueeze(1)
    p = torch.tensor([ps[i] for i in active], dtype=torch.float32, device=dev).unsqueeze(1)
    xa = x if len(active) == num_rows else x[rows]
    lse = xa.logsumexp(dim=-1, keepdim=True)
    thresh = torch.full((len(active), 1), float("-inf"), device=dev)
    pending = torch.arange(len(active), device=dev)  # indices into ``active`` still without a cut-off
    k_max = max((ks[i] for i in active if ks[i] < vocab), default=0)
    # The 1024 step only pays when a sort would cost much more than a 1024-candidate top-k (large vocabularies).
    sizes = sorted({min(vocab, max(64, k_max + 1)), vocab} | ({1024} if vocab >= 16 * 1024 else set()))
    for n in sizes:
        xr = xa if pending.numel() == len(active) else xa[pending]
        vals = xr.sort(dim=-1, descending=True).values if n == vocab else xr.topk(n, dim=-1).values
        cut, done = _cutoff(vals, lse[pending], k[pending], p[pending], vocab)
        thresh[pending[done]] = cut[done]
        pending = pending[~done]
        if pending.numel() == 0:
            break
    if len(active) == num_rows:
        x.masked_fill_(x < thresh, float("-inf"))
    else:
        xa = x[rows]
        x[rows] = xa.masked_fill_(xa < thresh, float("-inf"))
