"""Token sampling over a batch of logits.

Per step, for the rows of one batch (each row = one request's last position):

1. ``allowed_token_ids`` leave only those tokens; ``bad_words`` ban the token that would complete one; while a
   request has fewer outputs than ``min_tokens``, its eos (unless ``ignore_eos``) and ``stop_token_ids`` are
   banned, unless nothing else is left to sample (a complete grammar); ``logit_bias`` is added.
2. Penalties (``runner/penalties.py``): repetition, then frequency/presence - only for rows that use them.
3. Greedy rows (temperature < 1e-5) take the argmax of the penalised logits.
4. Other rows: divide by temperature, then min-p (drop tokens whose probability is below ``min_p`` times the
   most likely token's), then top-k (ties with the k-th logit are kept), then top-p over the renormalised
   remainder (keep the smallest prefix of the sorted distribution whose mass reaches ``top_p``) - vLLM's order.
5. Draw by inverse CDF: one uniform u per row, token = first i with cdf[i] > u * cdf[-1]. Seeded rows compute u
   from a hash of (seed, number of outputs so far), so a seeded request's tokens depend on nothing else in the
   batch and repeat after preemption + recompute; unseeded rows share one batched ``torch.rand``. One uniform per
   row (not one per vocabulary entry, as an exponential race needs) keeps the draw cheap on CPU.

Logprobs describe the RAW model distribution (log_softmax of the logits as given, as vLLM v1 returns by default):
the chosen token's logprob, its rank (1 + number of strictly more likely tokens) and the top N.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from strataserve import envs
from strataserve.types.outputs import TokenLogprobs
from strataserve.types.sampling import SamplingParams
from strataserve.runner import cpu_kernel
from strataserve.runner.penalties import add_bias, apply_penalties, ban_tokens

_MASK64 = (1 << 64) - 1


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first index of the largest value, NaN counting as largest. On CPU a float32 matrix
    takes the C pass of ``runner/cpu_layer_ops.c`` (0.29-0.45 of ``max``'s time at 64-256 rows), anything else
    ``max(...).indices``, which keeps the same rule in 0.35-0.78 of argmax's time (torch 2.13,
    ``benchmarks/cpu_argmax_ab.py``: 1-256 rows, vocabularies of 4,096-151,936)."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    if (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1
            and envs.STRATA_CPU_LAYER_OPS):
        lib = cpu_kernel.load_layer_ops()
        if lib is not None:
            out = torch.empty(x.shape[0], dtype=torch.int64)
            lib.strata_row_argmax(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1])
            return out
    return x.max(dim=-1).indices


@dataclass(slots=True)
class SamplingRequest:
    """What the sampler needs to know about one request. The runner owns it and appends each sampled token."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    #: greedy with nothing that reads the logits or past tokens otherwise: one argmax, no per-row host work
    plain_greedy: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = (p.greedy and not p.uses_penalties and p.logprobs is None and not p.logit_bias
                             and not p.allowed_token_ids and not p.bad_words_token_ids
                             and not (p.min_tokens and (p.stop_token_ids or not p.ignore_eos)))


def bad_word_bans(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens ``bad_words`` ban next: a one-token word always, a longer one's last token when the output
    ends with the rest of it (vLLM's rule)."""
    out = []
    for w in words:
        head = len(w) - 1
        if head == 0 or (len(output) >= head and list(output[len(output) - head:]) == list(w[:head])):
            out.append(w[-1])
    return out


def _unban_dead_rows(x: torch.Tensor, raw: torch.Tensor, rows: list[int]) -> None:
    """min_tokens yields where its ban would leave a row nothing to sample: a grammar that is complete allows only
    the stops (structured outputs end where the grammar does; the engine then finishes the request)."""
    rows_t = torch.tensor(rows, device=x.device)
    dead = ~torch.isfinite(x[rows_t]).any(dim=1)
    if bool(dead.any()):
        back = rows_t[dead]
        x[back] = raw[back]


def row_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed mixed from (request seed, output position) with splitmix64's finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def uniform(seed: int, step: int) -> float:
    """The seeded draw in [0, 1) for output position ``step``: 24 random bits, so float32 represents it exactly."""
    return (row_seed(seed, step) >> 39) / float(1 << 24)


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """p[t] < min_p * p_max  <=>  x[t] < x_max + log(min_p); done in logit space, no softmax needed."""
    thresh = x.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    x.masked_fill_(x < thresh, float("-inf"))


def _top_k(x: torch.Tensor, k: torch.Tensor, k_max: int) -> None:
    """Keep logits >= the row's k-th largest; ``k`` holds vocab_size for rows without top-k."""
    kth = x.topk(k_max, dim=-1).values.gather(1, (k.clamp(max=k_max) - 1).unsqueeze(1))
    kth.masked_fill_((k > k_max).unsqueeze(1), float("-inf"))
    x.masked_fill_(x < kth, float("-inf"))


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
        kr, pr = k[pending], p[pending]
        has_k = kr < vocab
        kth = vals.gather(1, kr.clamp(max=n) - 1)
        in_k = ~has_k | (vals >= kth)  # when k > n every candidate is >= the clamped kth
        probs = torch.where(in_k, (vals - lse[pending]).exp(), 0.0)
        # top-p acts on the top-k renormalised distribution: mass Z (1 without top-k; known once k <= n)
        z = torch.where(has_k, probs.sum(dim=-1, keepdim=True), 1.0)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = in_k & (mass_before < pr * z)  # a prefix; the first candidate always stays (p > 0)
        # Resolved when the cut-off falls inside the candidates (and the top-k mass Z was fully seen).
        done = (~keep[:, -1] & (~has_k[:, 0] | (kr[:, 0] <= n))) if n < vocab else torch.ones_like(keep[:, 0])
        cut = vals.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
        thresh[pending[done]] = cut[done]
        pending = pending[~done]
        if pending.numel() == 0:
            break
    if len(active) == num_rows:
        x.masked_fill_(x < thresh, float("-inf"))
    else:
        x[rows] = xa.masked_fill_(xa < thresh, float("-inf"))


class Sampler:
    """Stateless: every call depends only on its arguments (and the global torch RNG for unseeded rows)."""

    def __call__(self, logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(reqs), vocab] float. Returns one token id per row and its logprobs (None if not asked)."""
        tokens, logprobs = self.sample(logits, reqs)
        return tokens.tolist(), logprobs

    def sample(self, logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Like ``__call__`` but the token ids stay a tensor on the logits' device (no host sync when every row is
        plain greedy), so the caller may copy them back asynchronously."""
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits must be [len(reqs)={len(reqs)}, vocab], got {tuple(logits.shape)}")
        if all(r.plain_greedy for r in reqs):  # argmax of bf16 and of its float32 copy agree: skip the copy
            return row_argmax(logits), [None] * len(reqs)
        raw = logits.float()
        params = [r.params for r in reqs]
        x = self._processed(raw, reqs)

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == len(reqs):
            tokens = row_argmax(x)
        else:
            sample_rows = [i for i, p in enumerate(params) if not p.greedy]
            if greedy_rows:
                tokens = row_argmax(x)
                rows_t = torch.tensor(sample_rows, device=x.device)
                tokens[rows_t] = self._sample(x[rows_t], [reqs[i] for i in sample_rows])
            else:
                tokens = self._sample(x, reqs)
        return tokens, self._logprobs(raw, tokens, params)

    # ------------------------------------------------------------------ logits processing
    @staticmethod
    def _processed(raw: torch.Tensor, reqs: Sequence[SamplingRequest]) -> torch.Tensor:
        """Bans, biases, penalties; returns ``raw`` itself when nothing applies (the caller never writes to it)."""
        ban_rows: list[int] = []
        ban_ids: list[list[int]] = []
        bias_rows: list[int] = []
        pen_rows: list[int] = []
        allow_rows: list[int] = []
        for i, r in enumerate(reqs):
            p = r.params
            ids = []
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                ids = list(p.stop_token_ids)
                if r.eos_token_id is not None and not p.ignore_eos:
                    ids.append(r.eos_token_id)
            if p.bad_words_token_ids:
                ids += bad_word_bans(p.bad_words_token_ids, r.output_token_ids)
            if ids:
                ban_rows.append(i)
                ban_ids.append(ids)
            if p.allowed_token_ids:
                allow_rows.append(i)
            if p.logit_bias:
                bias_rows.append(i)
            if p.uses_penalties:
                pen_rows.append(i)
        if not ban_rows and not pen_rows and not bias_rows and not allow_rows:
            return raw
        x = raw.clone()
        for i in allow_rows:  # everything else is out: -inf
            keep = torch.full_like(x[i], float("-inf"))
            ids = [t for t in reqs[i].params.allowed_token_ids if t < x.shape[1]]
            keep[torch.tensor(ids, dtype=torch.long, device=x.device)] = 0.0
            x[i] += keep
        if ban_rows:
            allowed = x.clone() if allow_rows else raw  # a ban that empties a row yields to the allowed ids only
            ban_tokens(x, ban_rows, ban_ids)
            _unban_dead_rows(x, allowed, ban_rows)
        if bias_rows:
            add_bias(x, bias_rows, [reqs[i].params.logit_bias for i in bias_rows])
        if pen_rows:
            whole = len(pen_rows) == len(reqs)
            rows_t = None if whole else torch.tensor(pen_rows, device=x.device)
            sub = x if whole else x[rows_t]
            sel = [reqs[i] for i in pen_rows]
            apply_penalties(
                sub,
                [r.prompt_token_ids for r in sel],
                [r.output_token_ids for r in sel],
                [r.params.repetition_penalty for r in sel],
                [r.params.frequency_penalty for r in sel],
                [r.params.presence_penalty for r in sel],
            )
            if not whole:
                x[rows_t] = sub
        return x

    @staticmethod
    def filtered_logits(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p applied to (penalised) logits [R, V] of non-greedy rows; -inf = dropped.

        Returns a new tensor; ``softmax`` of it is the distribution the row samples from.
        """
        vocab = x.shape[1]
        dev = x.device
        temps = [p.temperature for p in params]
        x = x / torch.tensor(temps, dtype=torch.float32, device=dev).unsqueeze(1) if any(t != 1.0 for t in temps) else x.clone()
        if any(p.min_p > 0.0 for p in params):
            _min_p(x, torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev))
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(p.top_p < 1.0 for p in params):
            _top_k_top_p(x, ks, [p.top_p for p in params])
        elif any(k < vocab for k in ks):
            _top_k(x, torch.tensor(ks, dtype=torch.int64, device=dev), max(k for k in ks if k < vocab))
        return x

    # ------------------------------------------------------------------ drawing
    @classmethod
    def _sample(cls, x: torch.Tensor, reqs: Sequence[SamplingRequest]) -> torch.Tensor:
        """Inverse-CDF draw: token i is picked when cdf[i-1] <= u * cdf[-1] < cdf[i], so P(i) = p[i]."""
        probs = cls.filtered_logits(x, [r.params for r in reqs]).softmax(dim=-1)
        cdf = probs.cumsum_(dim=-1)
        total = cdf[:, -1:]
        u = torch.rand(len(reqs), 1, dtype=torch.float32, device=x.device)
        seeded = [(i, uniform(r.params.seed, len(r.output_token_ids))) for i, r in enumerate(reqs) if r.params.seed is not None]
        if seeded:
            rows, vals = zip(*seeded)
            u[list(rows), 0] = torch.tensor(vals, dtype=torch.float32).to(x.device)
        # Keep the target strictly below the total so it never lands on trailing zero-probability tokens; a
        # dropped token (p = 0) repeats its predecessor's cdf, so the strict search can never stop on it.
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        # The clamp only matters for NaN logits, which must not turn into an out-of-vocabulary id.
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)

    # ------------------------------------------------------------------ logprobs
    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
        return token_logprobs(raw, tokens, [p.logprobs for p in params])


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, top_ns: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Per row: the logprob and rank of ``tokens[row]`` under log_softmax(raw[row]) plus the top ``top_ns[row]``
    (None = no logprobs for that row)."""
    out: list[TokenLogprobs | None] = [None] * len(top_ns)
    rows = [i for i, n in enumerate(top_ns) if n is not None]
    if not rows:
        return out
    whole = len(rows) == len(top_ns)
    rows_t = None if whole else torch.tensor(rows, device=raw.device)
    lps = torch.log_softmax(raw if whole else raw[rows_t], dim=-1)
    chosen = (tokens if whole else tokens[rows_t]).unsqueeze(1)
    chosen_lp = lps.gather(1, chosen)
    ranks = ((lps > chosen_lp).sum(dim=-1) + 1).tolist()
    n_max = max(top_ns[i] or 0 for i in rows)
    top_ids: list[list[int]] = [[] for _ in rows]
    top_lps: list[list[float]] = [[] for _ in rows]
    if n_max > 0:
        top = lps.topk(min(n_max, lps.shape[1]), dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    chosen_l = chosen.squeeze(1).tolist()
    chosen_lp_l = chosen_lp.squeeze(1).tolist()
    for j, i in enumerate(rows):
        n = top_ns[i] or 0
        out[i] = TokenLogprobs(token_id=chosen_l[j], logprob=chosen_lp_l[j], rank=ranks[j],
                               top_token_ids=top_ids[j][:n], top_logprobs=top_lps[j][:n])
    return out
