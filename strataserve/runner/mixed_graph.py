"""CUDA graphs for steps that carry prompt tokens (prefill chunks, with or without decodes), one per token bucket.

Why: launched eagerly, such a step costs the host 16-36 ms (by host) on the Llama-3.1-8B shape (225 Triton launches,
129 cuBLAS calls and the wrappers' checks), whatever the prompt size, while the GPU needs 5-25 ms; a decode-only step
replays its graph (``cuda_graph.py``) in ~1 ms. So every step with prompt tokens was host-bound, and cutting
prompts into small chunks made each prompt cost more instead of keeping the decodes at pace (docs/gpu_notes.md).

How: the whole forward (embedding to final norm) is captured for a padded token count Tb (the bucket). Whatever
varies between steps lives in static buffers the graph reads, and every kernel's grid depends on Tb alone:
- token ids, positions and KV slots of rows [0, T); the padding rows [T, Tb) get slot -1 (store nothing);
- decode rows: the decode-attention launch covers Db = min(Tb, max_decodes) rows. Rows past the step's decodes
  get context 0: they attend to nothing and write zeros, which the prefill kernel (launched after it) overwrites
  for the prefill rows;
- prefill chunks: up to ``max_prefills`` segments (block tables, lengths, start offsets) and the prefill
  kernel's tile map with cdiv(Tb, BLOCK_M) + max_prefills entries (``kernels/prefill_tiles.py``), unused ones -1.
Matmuls, norms and activations are row-wise, so padding rows never touch real rows (padding rows past the decode
rows get no attention output at all: what they compute from that memory is garbage, and stays in them). The
final hidden rows are copied into one static output; the logits and the sampler then run eagerly on the rows
that sample, as on the eager path, so no bucket keeps a logits buffer.

Buckets are captured while the engine has nothing to run, largest first (``capture_next``; ~0.1 s each), or
else the first time a step needs one (about one eager step's time, and one device sync); the engine's start-up
is unchanged (the offline ``LLM`` captures the largest bucket at init, since it never idles).
All buckets share one memory pool, about the activations of the largest step, which the KV-cache sizing already
leaves free (it profiles a forward of ``max_num_batched_tokens``); eager steps then need that much again (run 9,
8B shape, 4,096 tokens: +0.5 GiB). A capture that fails (e.g. out of memory) turns the graphs off and the steps
run eagerly, with a warning.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from strataserve.kernels.prefill_tiles import PREFILL_BLOCK_M
from strataserve.runner.attention import AttentionMetadata

log = logging.getLogger(__name__)

#: ``forward(input_ids [Tb], positions [Tb], meta)`` -> final hidden ``[Tb, H]`` (the model's forward)
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token buckets: every 32 to 2,048, every 64 to 4,096, then every 128; and ``max_tokens``.

    Padding then costs at most ~3% of a step's matmul work from 1,024 tokens up, where steps are compute bound
    (run 9: with buckets of 64, a step of one 1,024-token prompt and ~25 decodes took 27.8 ms on the device
    against 26.2 ms eager). Buckets are captured while idle or when a step needs them, not at engine start-up
    (``engine/llm.py``: the offline ``LLM`` captures the largest one at init)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
    sizes = [*range(32, 2049, 32), *range(2112, 4097, 64), *range(4224, max_tokens + 1, 128)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class MixedStepGraphs:
    """Replays the forward of any step that fits a bucket (``can_run``) from static buffers (module docstring).

    ``use_graphs=False`` runs the same padded forward over the same buffers without capturing (CPU tests: it
    checks the padding, the decode rows and the tile map against the eager forward)."""

    def __init__(self, forward: Forward, max_tokens: int, max_decodes: int, max_prefills: int,
                 max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 use_graphs: bool = True) -> None:
        self.forward = forward
        self.sizes = mixed_graph_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_decodes = max_decodes
        self.max_prefills = max_prefills
        self.device = torch.device(device)
        self.use_graphs = use_graphs
        z = dict(device=self.device)
        i32 = dict(dtype=torch.int32, **z)
        tmax, w, p = self.max_tokens, max_blocks_per_seq, max_prefills
        self.input_ids = torch.zeros(tmax, dtype=torch.long, **z)
        self.positions = torch.zeros(tmax, dtype=torch.long, **z)
        self.slot_mapping = torch.full((tmax,), -1, dtype=torch.long, **z)
        self.decode_tables = torch.zeros(min(tmax, max_decodes), w, **i32)
        self.decode_lens = torch.zeros(min(tmax, max_decodes), **i32)
        self.start_loc = torch.zeros(p + 1, **i32)
        self.prefill_ctx = torch.zeros(p, **i32)
        self.prefill_lens = torch.zeros(p, **i32)
        self.prefill_tables = torch.zeros(p, w, **i32)
        self.tiles = torch.full((self._num_tiles(tmax), 2), -1, **i32)
        self.hidden = torch.zeros(tmax, hidden_size, dtype=dtype, **z)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.capture_seconds = 0.0
        self.disabled = False

    def _num_tiles(self, tokens: int) -> int:
        return -(-tokens // PREFILL_BLOCK_M) + self.max_prefills

    def bucket(self, tokens: int) -> int:
        return next(s for s in self.sizes if s >= tokens)

    def can_run(self, meta: AttentionMetadata, tokens: int) -> bool:
        return (not self.disabled and 0 < tokens <= self.max_tokens and meta.num_decode_tokens <= self.max_decodes
                and len(meta.prefills) <= self.max_prefills
                and (not meta.prefills or meta.prefill_tiles is not None)
                and meta.decode_block_tables.shape[1] <= self.decode_tables.shape[1]
                and meta.prefill_block_tables.shape[1] <= self.prefill_tables.shape[1])

    def _meta(self, tb: int) -> AttentionMetadata:
        """The bucket's metadata: views of the static buffers, shapes fixed by ``tb``."""
        db = min(tb, self.max_decodes)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tb], num_decode_tokens=db, decode_block_tables=self.decode_tables[:db],
            decode_context_lens=self.decode_lens[:db], prefill_query_start_loc=self.start_loc,
            prefill_context_lens=self.prefill_ctx, prefill_block_tables=self.prefill_tables,
            prefill_seq_lens=self.prefill_lens, prefill_tiles=self.tiles[:self._num_tiles(tb)],
            decode_groups=[], prefills=[], decode_rows_padded=True)

    def _step(self, tb: int) -> None:
        self.hidden[:tb].copy_(self.forward(self.input_ids[:tb], self.positions[:tb], self._meta(tb)))

    def _idle(self, tb: int) -> None:
        """Buffers of a step that touches nothing: no KV stores, no attention rows (capture warm-up)."""
        self.slot_mapping[:tb].fill_(-1)
        self.decode_lens.zero_()
        self.tiles.fill_(-1)

    @torch.inference_mode()
    def _capture(self, tb: int) -> None:
        t0 = time.perf_counter()
        self._idle(tb)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph: Triton compiles, cuBLAS picks its kernels
            self._step(tb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
            self._step(tb)
        self.graphs[tb] = g
        dt = time.perf_counter() - t0
        self.capture_seconds += dt
        log.info("captured the mixed-step CUDA graph for %d tokens in %.2f s", tb, dt)

    def capture_next(self) -> bool:
        """Capture the largest bucket not captured yet (the engine calls this while it has nothing to run, so
        serving steps rarely pay a capture; largest first, so the smaller ones reuse its pool memory).
        True while buckets remain."""
        missing = [s for s in self.sizes if s not in self.graphs] if self.use_graphs and not self.disabled else []
        if not missing:
            return False
        if not self._try_capture(missing[-1]):
            return False
        if len(missing) == 1:
            log.info("captured all %d mixed-step CUDA graphs (%.1f s of capture in all)", len(self.sizes),
                     self.capture_seconds)
        return len(missing) > 1

    def _try_capture(self, tb: int) -> bool:
        try:
            self._capture(tb)
            return True
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # graphs off, never the server
            log.warning("mixed-step CUDA graph capture failed (%s); prompt steps run eagerly from now on", exc)
            self.disabled = True
            self.close()
            return False

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden ``[T, H]`` of the step (a view of the static output: consume it before the next ``run``), or
        None if the bucket could not be captured (the graphs are then off: run the step eagerly)."""
        t = input_ids.shape[0]
        tb = self.bucket(t)
        if self.use_graphs and tb not in self.graphs and not self._try_capture(tb):
            return None
        self._fill(input_ids, positions, meta, t, tb)
        if self.use_graphs:
            self.graphs[tb].replay()
        else:
            self._step(tb)
        return self.hidden[:t]

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, t: int,
              tb: int) -> None:
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(meta.slot_mapping, non_blocking=True)
        if tb > t:
            self.slot_mapping[t:tb].fill_(-1)
        nd, db = meta.num_decode_tokens, min(tb, self.max_decodes)
        if nd:
            self.decode_tables[:nd, :meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables,
                                                                             non_blocking=True)
            self.decode_lens[:nd].copy_(meta.decode_context_lens, non_blocking=True)
        if db > nd:
            self.decode_lens[nd:db].zero_()
        p = len(meta.prefills)
        n_tiles = 0
        if p:
            self.start_loc[:p + 1].copy_(meta.prefill_query_start_loc, non_blocking=True)
            self.prefill_ctx[:p].copy_(meta.prefill_context_lens, non_blocking=True)
            assert meta.prefill_seq_lens is not None and meta.prefill_tiles is not None
            self.prefill_lens[:p].copy_(meta.prefill_seq_lens, non_blocking=True)
            self.prefill_tables[:p, :meta.prefill_block_tables.shape[1]].copy_(meta.prefill_block_tables,
                                                                              non_blocking=True)
            n_tiles = meta.prefill_tiles.shape[0]
            self.tiles[:n_tiles].copy_(meta.prefill_tiles, non_blocking=True)
        if self._num_tiles(tb) > n_tiles:
            self.tiles[n_tiles:self._num_tiles(tb)].fill_(-1)

    def close(self) -> None:
        self.graphs.clear()
        self._pool = None
