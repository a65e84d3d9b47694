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
from typing import TYPE_CHECKING, Sequence

import torch

from strataserve import envs
from strataserve.types.outputs import TokenLogprobs
from strataserve.types.sampling import SamplingParams
from strataserve.runner import cpu_kernel
from strataserve.runner.penalties import add_bias, apply_penalties, apply_penalties_counts, ban_tokens
from strataserve.runner.sampling_filters import filtered_logits, to_device

if TYPE_CHECKING:
    from strataserve.runner.token_history import TokenHistory

_MASK64 = (1 << 64) - 1
#: how ``token_logprobs_deferred`` computes logprobs: log_softmax + gather + count + topk, or the one-read kernel
LOGPROBS_PATHS = ("torch", "kernel")


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
    """What the sampler needs to know about one request. The model runner owns it: ``num_sampled`` counts the rows
    it has sampled for the request (bumped at launch), ``output_token_ids`` the tokens that have reached the host
    (appended by ``LaunchedStep.result``), so under async scheduling the count may run one ahead of the list."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    #: greedy with nothing that reads the logits or past tokens otherwise: one argmax, no per-row host work
    plain_greedy: bool = field(init=False, default=False)
    #: output positions sampled so far: the seeded draw's position and min_tokens' count
    num_sampled: int = field(init=False, default=0)
    #: its row in the runner's ``TokenHistory`` (penalties under async scheduling), -1 for none
    history_slot: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = (p.greedy and not p.uses_penalties and p.logprobs is None and not p.logit_bias
                             and not p.allowed_token_ids and not p.bad_words_token_ids
                             and not (p.min_tokens and (p.stop_token_ids or not p.ignore_eos)))
        self.num_sampled = len(self.output_token_ids)

    @property
    def position(self) -> int:
        """The output position sampled next: the runner's count, or the list's length for a caller that only
        appends (a standalone sampler)."""
        return max(self.num_sampled, len(self.output_token_ids))


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
    the stops (structured outputs end where the grammar does; the engine then finishes the request). Rows are
    chosen on the device (no sync)."""
    rows_t = to_device(rows, torch.int64, x.device)
    sub = x[rows_t]
    dead = ~torch.isfinite(sub).any(dim=1, keepdim=True)
    x[rows_t] = torch.where(dead, raw[rows_t], sub)


def row_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed mixed from (request seed, output position) with splitmix64's finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def uniform(seed: int, step: int) -> float:
    """The seeded draw in [0, 1) for output position ``step``: 24 random bits, so float32 represents it exactly."""
    return (row_seed(seed, step) >> 39) / float(1 << 24)


class Sampler:
    """Stateless: every call depends only on its arguments (and the global torch RNG for unseeded rows). Nothing
    in ``sample`` waits for the device, so an async runner keeps its overlap whatever the requests ask for."""

    def __call__(self, logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(reqs), vocab] float. Returns one token id per row and its logprobs (None if not asked)."""
        tokens, logprobs = self.sample(logits, reqs)
        return tokens.tolist(), resolve_logprobs(logprobs)

    def sample(self, logits: torch.Tensor, reqs: Sequence[SamplingRequest], history: TokenHistory | None = None
               ) -> tuple[torch.Tensor, "list[TokenLogprobs | None] | DeferredLogprobs"]:
        """Like ``__call__`` but the token ids stay a tensor on the logits' device and the logprobs may be a
        ``DeferredLogprobs`` (``resolve_logprobs`` reads them once the step is done), so the caller may copy them
        back asynchronously. ``history`` (async scheduling): the runner's per-request token counts on the device,
        which penalties read instead of the host lists (those lack the token still in flight)."""
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits must be [len(reqs)={len(reqs)}, vocab], got {tuple(logits.shape)}")
        if all(r.plain_greedy for r in reqs):  # argmax of bf16 and of its float32 copy agree: skip the copy
            return row_argmax(logits), [None] * len(reqs)
        raw = logits.float()
        params = [r.params for r in reqs]
        x = self._processed(raw, reqs, history)

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == len(reqs):
            tokens = row_argmax(x)
        else:
            sample_rows = [i for i, p in enumerate(params) if not p.greedy]
            if greedy_rows:
                tokens = row_argmax(x)
                rows_t = to_device(sample_rows, torch.int64, x.device)
                tokens[rows_t] = self._sample(x[rows_t], [reqs[i] for i in sample_rows])
            else:
                tokens = self._sample(x, reqs)
        return tokens, token_logprobs_deferred(raw, tokens, [p.logprobs for p in params])

    # ------------------------------------------------------------------ logits processing
    @staticmethod
    def _processed(raw: torch.Tensor, reqs: Sequence[SamplingRequest], history: TokenHistory | None = None
                   ) -> torch.Tensor:
        """Bans, biases, penalties; returns ``raw`` itself when nothing applies (the caller never writes to it)."""
        ban_rows: list[int] = []
        ban_ids: list[list[int]] = []
        bias_rows: list[int] = []
        pen_rows: list[int] = []
        allow_rows: list[int] = []
        for i, r in enumerate(reqs):
            p = r.params
            ids = []
            if p.min_tokens and r.position < p.min_tokens:
                ids = list(p.stop_token_ids)
                if r.eos_token_id is not None and not p.ignore_eos:
                    ids.append(r.eos_token_id)
            if p.bad_words_token_ids:  # a longer word reads the output: the engine keeps such requests synchronous
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
        if allow_rows:  # everything else is out: -inf
            keep = allowed_mask(x.shape[1], [reqs[i].params.allowed_token_ids for i in allow_rows], x.device)
            rows_t = to_device(allow_rows, torch.int64, x.device)
            x[rows_t] = x[rows_t].masked_fill_(~keep, float("-inf"))
        if ban_rows:
            allowed = x.clone() if allow_rows else raw  # a ban that empties a row yields to the allowed ids only
            ban_tokens(x, ban_rows, ban_ids)
            _unban_dead_rows(x, allowed, ban_rows)
        if bias_rows:
            add_bias(x, bias_rows, [reqs[i].params.logit_bias for i in bias_rows])
        if pen_rows:
            whole = len(pen_rows) == len(reqs)
            rows_t = None if whole else to_device(pen_rows, torch.int64, x.device)
            sub = x if whole else x[rows_t]
            sel = [reqs[i] for i in pen_rows]
            args = ([r.prompt_token_ids for r in sel], [r.params.repetition_penalty for r in sel],
                    [r.params.frequency_penalty for r in sel], [r.params.presence_penalty for r in sel])
            if history is None:
                apply_penalties(sub, args[0], [r.output_token_ids for r in sel], *args[1:])
            else:
                apply_penalties_counts(sub, *history.rows(sel), *args[1:])
            if not whole:
                x[rows_t] = sub
        return x

    @staticmethod
    def filtered_logits(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p applied to (penalised) logits [R, V] of non-greedy rows; -inf = dropped
        (``runner/sampling_filters.py``). Returns a new tensor; ``softmax`` of it is the row's distribution."""
        return filtered_logits(x, params)

    # ------------------------------------------------------------------ drawing
    @classmethod
    def _sample(cls, x: torch.Tensor, reqs: Sequence[SamplingRequest]) -> torch.Tensor:
        """Inverse-CDF draw: token i is picked when cdf[i-1] <= u * cdf[-1] < cdf[i], so P(i) = p[i]."""
        probs = cls.filtered_logits(x, [r.params for r in reqs]).softmax(dim=-1)
        cdf = probs.cumsum_(dim=-1)
        total = cdf[:, -1:]
        u = torch.rand(len(reqs), 1, dtype=torch.float32, device=x.device)
        if any(r.params.seed is not None for r in reqs):  # -1 = unseeded: keep the batched draw
            vals = [uniform(r.params.seed, r.position) if r.params.seed is not None else -1.0 for r in reqs]
            seeded = to_device(vals, torch.float32, x.device).unsqueeze(1)
            u = torch.where(seeded >= 0, seeded, u)
        # Keep the target strictly below the total so it never lands on trailing zero-probability tokens; a
        # dropped token (p = 0) repeats its predecessor's cdf, so the strict search can never stop on it.
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        # The clamp only matters for NaN logits, which must not turn into an out-of-vocabulary id.
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)


def allowed_mask(vocab: int, allowed: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """bool [len(allowed), vocab]: True at each row's allowed ids (ids outside the vocabulary are skipped)."""
    rows = [i for i, ids in enumerate(allowed) for t in ids if 0 <= t < vocab]
    cols = [t for ids in allowed for t in ids if 0 <= t < vocab]
    keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device)
    keep.index_put_((to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)),
                    torch.ones(len(rows), dtype=torch.bool, device=device))  # a Python True would sync
    return keep


class DeferredLogprobs:
    """A step's logprobs as device tensors, read into ``TokenLogprobs`` only by ``resolve`` (after the step is done,
    so the read does not stall the host while the device still works)."""

    __slots__ = ("rows", "size", "top_ns", "chosen", "chosen_lp", "ranks", "top_ids", "top_lps")

    def __init__(self, size: int, rows: list[int], top_ns: Sequence[int | None]) -> None:
        self.size, self.rows, self.top_ns = size, rows, top_ns
        self.chosen = self.chosen_lp = self.ranks = self.top_ids = self.top_lps = None

    def copy_to_host(self) -> None:
        """Start the device -> pinned host copies, so ``resolve`` (after the step's event) reads host memory instead
        of queueing a blocking copy behind whatever the device runs next."""
        for name in ("chosen", "chosen_lp", "ranks", "top_ids", "top_lps"):
            t = getattr(self, name)
            if t is not None and t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                setattr(self, name, host)

    def resolve(self) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * self.size
        if not self.rows:
            return out
        chosen, chosen_lp, ranks = self.chosen.tolist(), self.chosen_lp.tolist(), self.ranks.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in self.rows]
        top_lps = self.top_lps.tolist() if self.top_lps is not None else [[] for _ in self.rows]
        for j, i in enumerate(self.rows):
            n = self.top_ns[i] or 0
            out[i] = TokenLogprobs(token_id=chosen[j], logprob=chosen_lp[j], rank=ranks[j],
                                   top_token_ids=top_ids[j][:n], top_logprobs=top_lps[j][:n])
        return out


def resolve_logprobs(lps: "list[TokenLogprobs | None] | DeferredLogprobs") -> list[TokenLogprobs | None]:
    return lps.resolve() if isinstance(lps, DeferredLogprobs) else lps


def token_logprobs_deferred(raw: torch.Tensor, tokens: torch.Tensor, top_ns: Sequence[int | None],
                            path: str | None = None) -> "list[TokenLogprobs | None] | DeferredLogprobs":
    """Per row: the logprob and rank of ``tokens[row]`` under log_softmax(raw[row]) plus the top ``top_ns[row]``
    (None = no logprobs for that row); computed now, read by ``resolve``. A plain list when no row asks.

    ``path``: one of ``LOGPROBS_PATHS``; None: "torch" on CPU, else ``STRATA_LOGPROBS`` (default "kernel": one read
    of each row, ``kernels/token_logprobs.py``). Neither path syncs the host."""
    rows = [i for i, n in enumerate(top_ns) if n is not None]
    if not rows:
        return [None] * len(top_ns)
    path = _logprobs_path(path, raw)
    out = DeferredLogprobs(len(top_ns), rows, top_ns)
    whole = len(rows) == len(top_ns)
    rows_t = None if whole else to_device(rows, torch.int64, raw.device)
    chosen = tokens if whole else tokens[rows_t]
    n_max = max(top_ns[i] or 0 for i in rows)
    if path == "kernel":
        from strataserve.kernels.token_logprobs import row_logprob_stats  # (Triton only where used)

        # (top n up to the kernel's MAX_TOP_N, which covers SamplingParams' MAX_LOGPROBS)
        top_n = max(1, min(n_max, raw.shape[1]))
        _, out.chosen_lp, out.ranks, top_ids, top_lps = row_logprob_stats(raw, chosen, rows_t, top_n=top_n)
        out.chosen = chosen
        if n_max > 0:
            out.top_ids, out.top_lps = top_ids, top_lps
        return out
    lps = torch.log_softmax(raw if whole else raw[rows_t], dim=-1)
    chosen = chosen.unsqueeze(1)
    chosen_lp = lps.gather(1, chosen)
    out.ranks = (lps > chosen_lp).sum(dim=-1) + 1
    out.chosen, out.chosen_lp = chosen.squeeze(1), chosen_lp.squeeze(1)
    if n_max > 0:
        top = lps.topk(min(n_max, lps.shape[1]), dim=-1)
        out.top_ids, out.top_lps = top.indices, top.values
    return out


def _logprobs_path(path: str | None, raw: torch.Tensor) -> str:
    if path is None:  # (the kernel reads rows with a contiguous last dim; anything else keeps the torch path)
        usable = raw.dim() == 2 and (raw.stride(-1) == 1 or raw.shape[-1] == 1)
        return envs.STRATA_LOGPROBS if raw.device.type != "cpu" and usable else "torch"
    if path not in LOGPROBS_PATHS:
        raise ValueError(f"path: expected one of {LOGPROBS_PATHS}, got {path!r}")
    return path


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, top_ns: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """``token_logprobs_deferred``, read at once."""
    return resolve_logprobs(token_logprobs_deferred(raw, tokens, top_ns))
