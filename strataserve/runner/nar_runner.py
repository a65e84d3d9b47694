"""Non-autoregressive runner: iterative unmasking of a whole audio canvas (OmniVoice), whole requests per batch.

A request is its conditional input ids ``[C, c_len]`` (style + text (+ reference audio) + ``t_len`` mask ids) and
its unmasking settings. A batch of B requests becomes one canvas of 2B rows (B conditional rows padded to L_pad, then
B unconditional rows holding only the target canvas, padded to T_pad) in a bucket shape (B_pad, T_pad, L_pad), so
classifier-free guidance costs one forward. The unconditional rows keep their own, shorter length: padded to
L_pad they would spend ~(L_pad - T_pad) / (2 L_pad) of every forward on padding.

Every step: forward the canvas, score every target position (log-softmax with guidance, the mask id excluded;
argmax or Gumbel-sampled class), subtract the codebook-layer penalty, add Gumbel position noise, and unmask each
request's next ``k`` most confident masked positions, where ``k`` follows the reference's schedule (shifted time
steps, ``ceil`` of the masked count per step, the rest at the last step).

Randomness is per request: a generator seeded with the request's seed draws the same tensors, in the same order
and shapes, as the reference's global generator does for that request alone, so a request's tokens depend on its
seed, never on its batch. On CUDA the canvas forward and scoring of each bucket is one captured graph, replayed
every step; the selection (per-request noise, top-k) runs eagerly after it.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from strataserve.runner.nar_attention import CanvasMeta
from strataserve.types.speech import BatchStats

#: vocabulary fraction kept before class sampling (the reference's top-k filter ratio)
CLASS_TOP_RATIO = 0.1
_GUMBEL_EPS = 1e-10


@dataclass(frozen=True)
class UnmaskSettings:
    """One request's decoding settings (the reference's generation config names and defaults)."""

    num_step: int = 32
    guidance_scale: float = 2.0
    t_shift: float = 0.1
    layer_penalty_factor: float = 5.0
    position_temperature: float = 5.0
    class_temperature: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.num_step <= 256:
            raise ValueError(f"num_step={self.num_step}: must be in [1, 256]")
        if not 0.0 <= self.guidance_scale <= 20.0:
            raise ValueError(f"guidance_scale={self.guidance_scale}: must be in [0, 20]")
        if not 0.0 < self.t_shift <= 10.0:
            raise ValueError(f"t_shift={self.t_shift}: must be in (0, 10]")
        if self.position_temperature < 0 or self.class_temperature < 0:
            raise ValueError("position_temperature and class_temperature must be >= 0 (0 = greedy)")


@dataclass
class NARRequest:
    request_id: str
    input_ids: torch.Tensor  # long [C, c_len]: the conditional canvas, target = the last t_len columns (mask ids)
    audio_start: int  # first column embedded as audio (reference audio, then the target)
    target_len: int
    settings: UnmaskSettings = field(default_factory=UnmaskSettings)
    seed: int = 0
    started_at: float | None = None  # perf_counter when its batch began (set by the runner; queue-time metric)

    @property
    def cond_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def prefix_len(self) -> int:
        return self.cond_len - self.target_len


def unmask_schedule(target_len: int, num_codebooks: int, s: UnmaskSettings) -> list[int]:
    """How many positions each step unmasks (the reference's shifted-time schedule; sums to C * t_len)."""
    t = torch.linspace(0.0, 1.0, s.num_step + 1)
    t = (s.t_shift * t / (1 + (s.t_shift - 1) * t)).tolist()
    total = rem = target_len * num_codebooks
    out = []
    for step in range(s.num_step):
        n = rem if step == s.num_step - 1 else min(math.ceil(total * (t[step + 1] - t[step])), rem)
        out.append(int(n))
        rem -= int(n)
    return out


def round_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def batch_bucket(n: int) -> int:
    """1, 2, 4, 8, then multiples of 8: few graphs, at most 2x (then 8 rows) of batch padding."""
    return n if n <= 2 else (4 if n <= 4 else round_up(n, 8))


def gumbel(logits: torch.Tensor, temperature: float, noise: torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` plus Gumbel noise made from uniform ``noise`` (the reference's formula)."""
    return logits / temperature + -torch.log(-torch.log(noise + _GUMBEL_EPS) + _GUMBEL_EPS)


class _Canvas:
    """Static buffers of one bucket, and its scoring function (captured as a CUDA graph when asked): ``ids``
    ``[B, C, L]`` for the conditional rows and, when guided, ``ids_u`` ``[B, C, T]`` for the unconditional ones."""

    def __init__(self, runner: NARRunner, b: int, t: int, length: int, guided: bool) -> None:
        m, dev, c = runner.model, runner.device, runner.num_codebooks
        self.b, self.t, self.length, self.guided = b, t, length, guided
        self.ids = torch.full((b, c, length), runner.mask_id, dtype=torch.long, device=dev)
        self.audio_mask = torch.zeros(b, length, dtype=torch.bool, device=dev)
        self.lengths = torch.zeros(b, dtype=torch.long, device=dev)
        u = b if guided else 0  # no unconditional rows without guidance
        self.ids_u = torch.full((u, c, t), runner.mask_id, dtype=torch.long, device=dev)
        self.audio_mask_u = torch.zeros(u, t, dtype=torch.bool, device=dev)
        self.lengths_u = torch.zeros(u, dtype=torch.long, device=dev)
        self.rows_c = torch.zeros(b, t, dtype=torch.long, device=dev)
        self.rows_u = torch.zeros(b, t, dtype=torch.long, device=dev)
        self.guidance = torch.zeros(b, 1, 1, 1, dtype=torch.float32, device=dev)
        self.positions = torch.cat([torch.arange(length, device=dev).repeat(b),
                                    torch.arange(t, device=dev).repeat(u)])
        self.model, self.mask_id = m, runner.mask_id
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def score(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (log-probs [B, C, T, V], predicted ids [B, C, T], confidence [B, C, T]) for every target position."""
        groups, lengths = [(self.ids, self.audio_mask)], [(self.lengths, self.length)]
        if self.guided:
            groups.append((self.ids_u, self.audio_mask_u))
            lengths.append((self.lengths_u, self.t))
        hidden = self.model(groups, self.positions, CanvasMeta.from_lengths(*lengths))
        lp = F.log_softmax(self.model.target_logits(hidden, self.rows_c), dim=-1)
        if self.guided:
            lu = F.log_softmax(self.model.target_logits(hidden, self.rows_u), dim=-1)
            lp = torch.log_softmax(lp + self.guidance * (lp - lu), dim=-1)
        lp[..., self.mask_id] = -float("inf")
        return lp, lp.argmax(dim=-1), lp.max(dim=-1)[0]

    def capture(self, pool: object) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: autotuning and lazy initialisation happen outside the capture
                self.score()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self.score()

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.graph is None:
            return self.score()
        self.graph.replay()
        assert self.out is not None
        return self.out


class NARRunner:
    """Runs batches of whole requests to completion (``generate``); buckets pad T and L to ``len_step``."""

    def __init__(self, model: torch.nn.Module, *, num_codebooks: int, mask_id: int, cuda_graphs: bool = False,
                 len_step: int = 16, max_graphs: int = 16) -> None:
        self.model = model
        self.device = model.device
        self.num_codebooks, self.mask_id = num_codebooks, mask_id
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.len_step = len_step
        self.max_graphs = max_graphs
        self._canvases: OrderedDict[tuple[int, int, int, bool], _Canvas] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        #: called with a ``BatchStats`` after every batch (metrics)
        self.observers: list[Callable[[BatchStats], None]] = []

    def bucket(self, reqs: list[NARRequest]) -> tuple[int, int, int]:
        t = round_up(max(r.target_len for r in reqs), self.len_step)
        # room for every request's prefix plus the padded target: padded target columns stay inside the canvas
        length = round_up(max(r.prefix_len for r in reqs) + t, self.len_step)
        return batch_bucket(len(reqs)), t, length

    def _canvas(self, key: tuple[int, int, int, bool]) -> _Canvas:
        cv = self._canvases.get(key)
        if cv is None:
            cv = _Canvas(self, *key)
            if self.cuda_graphs:
                if len(self._canvases) >= self.max_graphs:
                    self._canvases.popitem(last=False)
                cv.capture(self._pool)
            self._canvases[key] = cv
        self._canvases.move_to_end(key)
        return cv

    @torch.inference_mode()
    def generate(self, reqs: list[NARRequest], should_stop: Callable[[], bool] | None = None
                 ) -> list[torch.Tensor] | None:
        """Unmask every request's canvas; returns long ``[C, t_len]`` per request (on the model's device).
        All requests of one batch must share ``settings.num_step`` and ``settings.guidance_scale == 0`` or not.
        ``should_stop`` is asked before each step (no device sync): True abandons the batch (returns None)."""
        s0 = reqs[0].settings
        if any(r.settings.num_step != s0.num_step or (r.settings.guidance_scale == 0) != (s0.guidance_scale == 0)
               for r in reqs):
            raise ValueError("one batch needs one num_step and guidance on (or off) for all its requests")
        start = time.perf_counter()
        for r in reqs:
            r.started_at = start
        b_pad, t_pad, l_pad = self.bucket(reqs)
        guided = s0.guidance_scale != 0
        cv = self._canvas((b_pad, t_pad, l_pad, guided))
        tokens = self._fill(cv, reqs)
        c, dev = self.num_codebooks, self.device
        scheds = torch.tensor([unmask_schedule(r.target_len, c, r.settings) for r in reqs]
                              + [[0] * s0.num_step] * (b_pad - len(reqs)))
        scheds_dev = scheds.to(dev)
        gens = [torch.Generator(device=dev).manual_seed(r.seed) for r in reqs]
        valid = (torch.arange(t_pad, device=dev)[None, :] <
                 torch.tensor([r.target_len for r in reqs] + [0] * (b_pad - len(reqs)), device=dev)[:, None])
        penalty = torch.tensor([r.settings.layer_penalty_factor for r in reqs] + [0.0] * (b_pad - len(reqs)),
                               device=dev).view(-1, 1, 1) * torch.arange(c, device=dev).view(1, -1, 1)
        cols = (cv.rows_c - torch.arange(b_pad, device=dev)[:, None] * l_pad)[:, None, :].expand(-1, c, -1)
        for step in range(s0.num_step):
            if should_stop is not None and should_stop():
                return None
            lp, pred, conf = cv.run()
            ks = scheds[:, step].tolist()
            pred = self._sample_classes(reqs, ks, gens, lp, pred)
            scores = self._position_scores(reqs, ks, gens, conf - penalty)
            scores.masked_fill_(~valid[:, None, :] | (tokens != self.mask_id), -float("inf"))
            order = scores.view(b_pad, -1).argsort(dim=-1, descending=True, stable=True)
            take = torch.arange(order.shape[1], device=dev)[None, :] < scheds_dev[:, step, None]
            chosen = torch.zeros_like(take).scatter_(1, order, take).view_as(tokens)
            tokens = torch.where(chosen, pred, tokens)
            cv.ids.scatter_(2, cols, tokens)
            if guided:
                cv.ids_u.copy_(tokens)
        for ob in self.observers:
            real = sum(r.cond_len + (r.target_len if guided else 0) for r in reqs)
            total = b_pad * l_pad + cv.ids_u.shape[0] * t_pad
            ob(BatchStats(len(reqs), (b_pad, t_pad, l_pad), 1.0 - real / total, time.perf_counter() - start))
        return [tokens[i, :, :r.target_len] for i, r in enumerate(reqs)]

    def _fill(self, cv: _Canvas, reqs: list[NARRequest]) -> torch.Tensor:
        """Write the batch into the bucket's buffers; returns the target tokens ``[B_pad, C, T_pad]`` (all mask)."""
        b, t, length, dev = cv.b, cv.t, cv.length, self.device
        cv.ids.fill_(self.mask_id)
        cv.ids_u.fill_(self.mask_id)
        cv.audio_mask.zero_()
        cv.audio_mask_u.zero_()
        lengths, lengths_u = [0] * b, [0] * cv.ids_u.shape[0]
        ar = torch.arange(t)
        rows_c = torch.stack([i * length + ar for i in range(b)])
        # the unconditional rows follow all B conditional rows; without guidance rows_u is never read
        rows_u = torch.stack([b * length + i * t + ar for i in range(b)])
        guidance = torch.zeros(b)
        for i, r in enumerate(reqs):
            cv.ids[i, :, :r.cond_len] = r.input_ids.to(dev)
            cv.audio_mask[i, r.audio_start:r.cond_len] = True
            lengths[i] = r.cond_len
            rows_c[i] += r.prefix_len
            guidance[i] = r.settings.guidance_scale
            if cv.guided:
                cv.audio_mask_u[i, :r.target_len] = True
                lengths_u[i] = r.target_len
        cv.lengths.copy_(torch.tensor(lengths))
        cv.lengths_u.copy_(torch.tensor(lengths_u, dtype=torch.long))
        cv.rows_c.copy_(rows_c)
        cv.rows_u.copy_(rows_u)
        cv.guidance.copy_(guidance.view(-1, 1, 1, 1))
        return torch.full((b, self.num_codebooks, t), self.mask_id, dtype=torch.long, device=dev)

    def _sample_classes(self, reqs: list[NARRequest], ks: list[int], gens: list[torch.Generator],
                        lp: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """Gumbel-sampled ids for requests with a class temperature (drawn before the position noise)."""
        hot = [i for i, r in enumerate(reqs) if r.settings.class_temperature > 0 and ks[i] > 0]
        if not hot:
            return pred
        pred = pred.clone()
        keep = math.ceil(CLASS_TOP_RATIO * lp.shape[-1])
        for i in hot:
            r = reqs[i]
            x = lp[i:i + 1, :, :r.target_len]
            val, ind = x.topk(keep, dim=-1)
            filtered = torch.full_like(x, float("-inf")).scatter_(-1, ind, val)
            noise = torch.rand(filtered.shape, generator=gens[i], device=self.device, dtype=filtered.dtype)
            pred[i, :, :r.target_len] = gumbel(filtered, r.settings.class_temperature, noise).argmax(dim=-1)[0]
        return pred

    def _position_scores(self, reqs: list[NARRequest], ks: list[int], gens: list[torch.Generator],
                         scores: torch.Tensor) -> torch.Tensor:
        temps = [r.settings.position_temperature for r in reqs]
        if not any(t > 0 for t in temps):
            return scores
        out = scores.clone()
        for i, r in enumerate(reqs):
            if temps[i] > 0 and ks[i] > 0:
                x = scores[i:i + 1, :, :r.target_len]
                noise = torch.rand(x.shape, generator=gens[i], device=self.device, dtype=x.dtype)
                out[i:i + 1, :, :r.target_len] = gumbel(x, temps[i], noise)
        return out
