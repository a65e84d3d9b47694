"""CUDA-graph capture of decode steps, one graph per batch-size bucket.

A decode step is the same short chain of kernels every time; launching them one by one costs ~10 µs each on the
host, which at batch 1 is as long as the GPU work itself. We capture the step once per bucket size
(1, 2, 4, 8, 16, 24, 32, ... up to ``max_bs``) over static input buffers and replay it: the host then only copies
the step's inputs into the buffers. A batch of n sequences runs in the smallest captured bucket >= n (a server
captures a few at start-up and the rest while idle: ``capture(sizes)``, ``capture_next``); the padding rows get
slot ``pad_slot`` and context length 0 (they attend to nothing), so they never touch real state. ``pad_slot`` -1
means "store nothing" (Triton backend); the torch backend's ``index_copy_`` needs a real slot, so a runner using
it passes a slot of a spare block that no request owns.
Prefill and mixed steps run eagerly.

The step function is given by the model runner; it must be capturable: no host synchronisation, no allocation
whose size depends on tensor values, and the same kernel launches whatever the values in the buffers.
A step that needs more per-row inputs than token ids (e.g. the TTS talker: embeddings, sampling settings) names
them as ``extra`` buffers ``[max_bs, ...]``; it receives their bucket rows as keyword arguments, and ``run`` copies
the caller's rows in. Their padding rows keep whatever they last held (real, finite values once any ran, the
caller's initial fill before), so the step must keep padding rows to their own state.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from strataserve.runner.attention import AttentionMetadata, DecodeGroup

log = logging.getLogger(__name__)

#: the buckets a server captures before it is ready (``RunnerConfig.defer_cuda_graphs``; the largest too, whose
#: memory pool the others reuse): powers of two, so that until the engine, idle, has captured a batch's own bucket,
#: it replays one of at most twice its rows (~0.05-0.1 s per capture; all 35 buckets took 1.6-4.0 s of the 8B
#: start-up in run 20).
STARTUP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)

#: ``step(input_ids[B], positions[B], slot_mapping[B], block_tables[B, W], context_lens[B])`` -> a tensor
#: ``[B, ...]`` or a tuple of them (e.g. logits and their argmax)
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                      torch.Tensor | tuple[torch.Tensor, ...]]


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself)."""
    if max_bs < 1:
        raise ValueError(f"max_bs={max_bs}: must be >= 1")
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return sorted(set(sizes + [max_bs]))


def decode_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    block_size: int, torch_views: bool = True) -> AttentionMetadata:
    """Decode-only ``AttentionMetadata`` built with tensor ops alone (no host sync), so it can be captured.

    Carries the generic fields (Triton backend) and, with ``torch_views``, one ``DecodeGroup`` spanning the batch
    (torch backend; a Triton graph leaves it out, so no unused mask is built in every replay).
    """
    n, nb = block_tables.shape
    empty = torch.zeros(0, dtype=torch.int32, device=block_tables.device)
    groups = []
    if torch_views:
        cols = torch.arange(nb * block_size, device=block_tables.device)
        mask = (cols[None, :] < context_lens[:, None]).view(n, 1, 1, nb * block_size)
        groups = [DecodeGroup(0, n, block_tables.long(), mask)]
    return AttentionMetadata(
        slot_mapping=slot_mapping, num_decode_tokens=n, decode_block_tables=block_tables,
        decode_context_lens=context_lens,
        prefill_query_start_loc=torch.full((1,), n, dtype=torch.int32, device=block_tables.device),
        prefill_context_lens=empty, prefill_block_tables=empty.view(0, 1),
        decode_groups=groups, prefills=[])


@dataclass
class _Buffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


class CudaGraphDecoder:
    """Captures ``step`` for every bucket size and replays the right graph for a decode batch."""

    def __init__(self, step: DecodeStep, max_bs: int, max_blocks_per_seq: int, device: torch.device,
                 pad_slot: int = -1, extra: dict[str, torch.Tensor] | None = None) -> None:
        self.step = step
        self.pad_slot = pad_slot
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.device = torch.device(device)
        z = dict(device=self.device)
        self.buf = _Buffers(
            input_ids=torch.zeros(self.max_bs, dtype=torch.long, **z),
            positions=torch.zeros(self.max_bs, dtype=torch.long, **z),
            slot_mapping=torch.full((self.max_bs,), pad_slot, dtype=torch.long, **z),
            block_tables=torch.zeros(self.max_bs, max_blocks_per_seq, dtype=torch.int32, **z),
            context_lens=torch.zeros(self.max_bs, dtype=torch.int32, **z))
        self.extra = dict(extra or {})
        for name, t in self.extra.items():
            if t.shape[0] < self.max_bs or t.device != self.device:
                raise ValueError(f"extra buffer {name!r}: needs >= {self.max_bs} rows on {self.device}, "
                                 f"got {tuple(t.shape)} on {t.device}")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self.capture_seconds = 0.0
        self._pool = None  # the memory pool every bucket shares (the largest bucket's, captured first)

    def _views(self, bs: int) -> tuple[torch.Tensor, ...]:
        b = self.buf
        return b.input_ids[:bs], b.positions[:bs], b.slot_mapping[:bs], b.block_tables[:bs], b.context_lens[:bs]

    def _extra_views(self, bs: int) -> dict[str, torch.Tensor]:
        return {name: t[:bs] for name, t in self.extra.items()}

    @torch.inference_mode()
    def capture(self, sizes: Iterable[int] | None = None) -> float:
        """Capture ``sizes`` (default: every bucket; the largest is always captured), largest first (so smaller ones
        reuse its memory pool); returns seconds taken. Buckets left out run in the next larger captured one until
        ``capture_next`` adds them."""
        t0 = time.perf_counter()
        # (sizes past max_bs, e.g. STARTUP_SIZES under a small --max-num-seqs, are covered by max_bs itself)
        want = set(self.sizes) if sizes is None else \
            {self.bucket_of(b) for b in sizes if b <= self.max_bs} | {self.max_bs}
        for bs in sorted(want - set(self.graphs), reverse=True):
            self._capture_one(bs)
        torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.capture_seconds += dt
        return dt

    def missing(self) -> list[int]:
        """The buckets not captured yet, ascending."""
        return [b for b in self.sizes if b not in self.graphs]

    def capture_next(self) -> bool:
        """Capture the largest bucket still missing (deferred start-up work); True while more remain. A capture
        that fails (e.g. out of memory) ends the deferred work with a warning: the graphs captured so far serve on
        (``stop_capturing``), the server never sees the error."""
        left = self.missing()
        if not left:
            return False
        try:
            self.capture([left[-1]])
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            log.warning("deferred decode CUDA graph capture failed (%s); batches keep replaying the next larger "
                        "captured graph", exc)
            self.stop_capturing()
            return False
        if len(left) == 1:
            log.info("captured all %d decode CUDA graphs (%.1f s of capture in all)", len(self.sizes),
                     self.capture_seconds)
        return len(left) > 1

    def stop_capturing(self) -> None:
        """Keep the buckets captured so far as the only ones (a deferred capture failed): ``missing`` is then
        empty and every batch replays the smallest captured bucket that holds it."""
        self.sizes = sorted(self.graphs)
        self.outputs = {b: o for b, o in self.outputs.items() if b in self.graphs}

    def _capture_one(self, bs: int) -> None:
        # the warm-up runs the step for real: after serving, the buffers still hold the last batch's slots, so
        # every row is made padding first (store nothing, attend to nothing)
        self.buf.slot_mapping[:bs].fill_(self.pad_slot)
        self.buf.context_lens[:bs].zero_()
        args, kw = self._views(bs), self._extra_views(bs)
        # warm-up outside the graph: Triton compiles, cuBLAS picks its kernels
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self.step(*args, **kw)
        torch.cuda.current_stream(self.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self.outputs[bs] = self.step(*args, **kw)
        self._pool = g.pool()
        self.graphs[bs] = g

    def bucket_of(self, batch: int) -> int:
        """The bucket size a batch of ``batch`` rows belongs to (captured or not)."""
        return next(s for s in self.sizes if s >= batch)

    def can_run(self, batch: int, num_block_cols: int) -> bool:
        return 0 < batch <= self.max_bs and num_block_cols <= self.buf.block_tables.shape[1]

    def bucket(self, batch: int) -> int:
        """The captured graph a batch of ``batch`` rows replays: its own bucket, or the next larger one captured."""
        return next(s for s in self.sizes if s >= batch and s in self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor,
            **extra: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Copy a decode batch of n rows (and its ``extra`` rows, one tensor per named buffer) into the buffers,
        replay its bucket's graph, return the first n rows (of each output, if the step returns a tuple).

        The returned tensors are the graph's static outputs: read them before the next ``run``.
        """
        n = input_ids.shape[0]
        if not self.can_run(n, block_tables.shape[1]):
            raise ValueError(f"decode batch {n} x {block_tables.shape[1]} blocks does not fit the captured graphs "
                             f"(max batch {self.max_bs}, {self.buf.block_tables.shape[1]} blocks)")
        if extra.keys() != self.extra.keys():
            raise ValueError(f"extra inputs {sorted(extra)} do not match the captured ones {sorted(self.extra)}")
        bs = self.bucket(n)
        b = self.buf
        for name, src in extra.items():
            self.extra[name][:n].copy_(src, non_blocking=True)
        b.input_ids[:n].copy_(input_ids, non_blocking=True)
        b.positions[:n].copy_(positions, non_blocking=True)
        b.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        b.context_lens[:n].copy_(context_lens, non_blocking=True)
        w = block_tables.shape[1]
        b.block_tables[:n, :w].copy_(block_tables, non_blocking=True)
        if bs > n:  # padding rows: store nothing, attend to nothing
            b.slot_mapping[n:bs].fill_(self.pad_slot)
            b.context_lens[n:bs].zero_()
        self.graphs[bs].replay()
        out = self.outputs[bs]
        return out[:n] if isinstance(out, torch.Tensor) else tuple(t[:n] for t in out)

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
