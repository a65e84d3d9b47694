"""``TTSRunner``: the Qwen3-TTS talker on the paged KV cache, driven by the LLM engine's scheduler.

The scheduler sees a TTS request as token ids: P placeholder ids for the prompt (its rows are embeddings, which
the runner holds) followed by the generated first-codebook ids. It does continuous batching, chunked prefill and
preemption by recompute exactly as for text; prefix caching must be off (placeholder ids are not content).

Per step: every scheduled position p of a request maps to its input row: prompt row p (p < P), or frame
k = p - P: the sum of that frame's codebook embeddings plus the k-th trailing text row (tts_pad once the text is
used up). A position whose frame is still missing codebooks 1..G-1 (the newest codebook-0 id: every decode step,
and the last token of a recompute after preemption) first gets them from the code predictor, batched over all
such rows, from the hidden state the talker produced before it. Then the talker runs over the flat batch, the
control ids at the top of the vocabulary are suppressed (eos excepted) and codebook 0 is sampled with the LLM
sampler (repetition penalty, min 2 frames before eos, temperature/top-k/top-p, per-request seeds).

An all-decode step (every row is a fresh frame of a decoding request, the common case) runs as one fused step:
code predictor loop -> frame embedding -> talker -> logits, with no host sync inside; on CUDA it is captured per
batch bucket with the LLM runner's ``CudaGraphDecoder`` (the step's embeddings and sampling settings travel as its
extra buffers), so a step is a few input copies and one replay instead of ~340 kernel launches. A batch whose code
predictor is greedy in every row replays a second set of graphs that take the argmax alone: the general one runs
the whole sampling pipeline (sort, two softmaxes, cumsums, search) for each of the G-1 codebooks and then keeps
the argmax for greedy rows, about a quarter of the step's kernels. Mixed steps (prefill chunks, recompute) run
eagerly as above.

Seeded requests: every draw is per request (codebook 0 from (seed, frame), the others from (seed, codebook,
frame)), so a seeded request's frames depend on its batch only through float rounding: torch's CPU matmul picks
its kernel by row count (one row vs several differ in the last bits), decode attention pads K/V to the batch's
longest context, and a preempted request's hidden state comes from a prefill instead of a decode. That moves
float32 logits by ~1e-6 and flips a draw only when it lands that close to a boundary (none in the tests); bitwise
batch invariance would need batch-invariant matmul and attention kernels for every runner, not this one.

Completed frames accumulate in each request's ``TTSRequestState.frames``, which the engine front reads; the state
lives from ``register`` to ``release`` (it must outlive a preemption, when the scheduler makes the runner forget
the request), so the front releases it once it has read the last frame.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field

import torch

from strataserve.types.outputs import ModelRunnerOutput, SchedulerOutput
from strataserve.types.sampling import SamplingParams
from strataserve.models.qwen3_tts.prompt import TalkerPrompt
from strataserve.models.qwen3_tts.talker import Qwen3TTSTalker
from strataserve.runner.attention import AttentionMetadata, TorchAttention, allocate_kv_cache
from strataserve.runner.base import ModelRunnerBase
from strataserve.runner.cuda_graph import CudaGraphDecoder, decode_metadata, graph_batch_sizes
from strataserve.runner.input_batch import BlockTableRows, build_input_batch
from strataserve.runner.sampler import Sampler, SamplingRequest, row_seed, uniform
from strataserve.runner.tts_code_predictor import CodePredictorLoop, RowSampling


def host_list(t: torch.Tensor) -> list:
    """``t.tolist()``, waiting for the GPU with the GIL released. A plain ``tolist`` of a CUDA tensor holds the GIL
    for the whole wait on the step's kernels, which starves the event loop and the codec thread of the server
    (its first audio then waits behind every step); a pinned copy plus an event wait does not."""
    if not t.is_cuda:
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()  # releases the GIL while it waits
    return host.tolist()


@dataclass(frozen=True)
class CodeSampling:
    """How the code predictor picks codebooks 1..G-1 (the reference's ``subtalker_*`` settings)."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class TTSRequestState:
    prompt: TalkerPrompt
    params: SamplingParams  # codebook 0
    code_sampling: CodeSampling
    frames: list[list[int]] = field(default_factory=list)  # complete frames, G codes each
    sampling: SamplingRequest | None = None
    past_hidden: torch.Tensor | None = None  # talker hidden state at the newest sampled position
    ref_frames: list[list[int]] = field(default_factory=list)  # in-context cloning: decoded before ``frames``


class TTSRunner(ModelRunnerBase):
    def __init__(self, model: Qwen3TTSTalker, *, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, cuda_graphs: bool = False) -> None:
        self.model = model
        cfg = model.config
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        t = cfg.talker
        self.kv_caches = allocate_kv_cache(t.num_layers, num_blocks + 1, block_size, t.num_kv_heads, t.head_dim,
                                           model.dtype, model.device)
        self._torch_views = isinstance(model.talker.ops.attention, TorchAttention)
        self._rows = BlockTableRows(max_num_seqs, -(-max_model_len // block_size))
        self.cp = CodePredictorLoop(model, max_num_seqs)
        self.sampler = Sampler()
        self.eos_id = cfg.codec_eos_id
        self._suppress = torch.tensor(cfg.suppressed_ids, dtype=torch.long, device=model.device)
        self.fused_steps = 0  # all-decode steps run fused (replayed, or eagerly without graphs)
        self.graph_steps = 0  # ... of which replayed a captured graph
        self.graphs: CudaGraphDecoder | None = None
        self.greedy_graphs: CudaGraphDecoder | None = None  # every row's code predictor greedy
        if cuda_graphs:
            self.cp.capture(graph_batch_sizes(max_num_seqs))  # mixed steps still replay the inner loop alone
            self.graphs = self._capture_decode(max_num_seqs, greedy_only=False)
            self.greedy_graphs = self._capture_decode(max_num_seqs, greedy_only=True)
        self.states: dict[str, TTSRequestState] = {}
        self._active: set[str] = set()
        self._released: collections.deque[str] = collections.deque()  # appended by the front's thread

    # ------------------------------------------------------------------ request state (front-end side)
    def register(self, req_id: str, state: TTSRequestState) -> None:
        """Hand over a request's prompt before the engine core sees the request."""
        self.states[req_id] = state

    def release(self, req_id: str, deferred: bool = True) -> None:
        """Drop a request's state once the front has read its frames. ``deferred`` (another thread calls): the
        engine thread drops it at its next step that does not schedule the request (an abort may still be
        queued behind a step that does); immediate only from the engine's own thread."""
        if deferred:
            self._released.append(req_id)
        else:
            self.states.pop(req_id, None)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for rid in scheduler_output.finished_req_ids:
            self._active.discard(rid)
            self._rows.forget(rid)
        for nr in scheduler_output.new_requests:
            st = self.states.get(nr.req_id)
            if st is None:
                raise RuntimeError(f"{nr.req_id}: scheduled before its prompt was registered with the runner")
            st.sampling = SamplingRequest(nr.sampling_params, [], list(nr.output_token_ids), self.eos_id)
            self._active.add(nr.req_id)
        chunks = scheduler_output.chunks
        self._drop_released({c.req_id for c in chunks})
        if not chunks:
            return ModelRunnerOutput([], [], [])
        m = self.model
        # bound per step (an attribute store): several runners may share one loaded model, one at a time
        m.talker.ops.attention.bind_kv_cache(self.kv_caches)
        batch = build_input_batch(chunks, self.block_size, m.device, m.dtype, self._torch_views, self._rows)
        dec = [chunks[i] for i in batch.decode_chunk_ids]
        if len(dec) == len(chunks) and len(batch.sample_chunk_ids) == len(chunks) and self._all_fresh_frames(dec):
            return self._execute_decode(chunks, dec, batch)
        pre = [c for c in chunks if len(c.token_ids) != 1]
        self._complete_frames(dec + pre)
        parts = ([self._decode_rows(dec)] if dec else []) + [self._rows_for(c) for c in pre]
        embeds = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        hidden = m.talker(None, batch.positions, batch.attn_meta, inputs_embeds=embeds)
        if not batch.sample_chunk_ids:
            return ModelRunnerOutput([], [], [])
        last = hidden.index_select(0, batch.logits_indices)
        logits = m.talker.compute_logits(last)
        logits.index_fill_(1, self._suppress, float("-inf"))
        return self._sample(chunks, batch.sample_chunk_ids, last, logits)

    def _sample(self, chunks, sample_chunk_ids: list[int], last: torch.Tensor,
                logits: torch.Tensor) -> ModelRunnerOutput:
        """Codebook 0 for every sampling chunk (logits rows in ``sample_chunk_ids`` order, control ids already
        suppressed); ``last`` holds their talker hidden states, the next frame's code predictor input."""
        req_ids = [chunks[i].req_id for i in sample_chunk_ids]
        states = [self.states[r] for r in req_ids]
        tokens, _ = self.sampler(logits, [s.sampling for s in states])  # type: ignore[misc]
        for j, (st, tok) in enumerate(zip(states, tokens)):
            st.sampling.output_token_ids.append(tok)  # type: ignore[union-attr]
            st.past_hidden = last[j]
        return ModelRunnerOutput(req_ids, tokens, [None] * len(tokens))

    # ------------------------------------------------------------------ the fused all-decode step
    def _all_fresh_frames(self, dec) -> bool:
        """Every one-token chunk carries its request's newest codebook-0 id (not a one-token prompt piece)."""
        for c in dec:
            st = self.states[c.req_id]
            if c.start_pos - st.prompt.length != len(st.frames):
                return False
        return True

    def _execute_decode(self, chunks, dec, batch) -> ModelRunnerOutput:
        """One decode row per chunk of ``dec`` (batch row order): complete each frame, run the talker on it and
        sample codebook 0 -- one graph replay when a captured bucket fits, else the same step eagerly."""
        m = self.model
        states = [self.states[c.req_id] for c in dec]
        first_ids = [st.sampling.output_token_ids[len(st.frames)] for st in states]  # type: ignore[union-attr]
        greedy = all(st.code_sampling.greedy for st in states)
        s = self._row_sampling(states)
        extra = dict(past_hidden=torch.stack([st.past_hidden for st in states]),  # type: ignore[misc]
                     text=torch.stack([st.prompt.text_row(len(st.frames)) for st in states]),
                     temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, greedy=s.greedy,
                     uniforms=self._uniforms(states))
        first = torch.tensor(first_ids, device=m.device)
        meta = batch.attn_meta
        self.fused_steps += 1
        graphs = self.greedy_graphs if greedy and self.greedy_graphs is not None else self.graphs
        if graphs is not None and graphs.can_run(len(dec), meta.decode_block_tables.shape[1]):
            self.graph_steps += 1
            codes, hidden, logits = graphs.run(first, batch.positions, meta.slot_mapping, meta.decode_block_tables,
                                               meta.decode_context_lens, **extra)
        else:
            codes, hidden, logits = self._fused_decode(meta, first, batch.positions, greedy_only=greedy, **extra)
        for st, c0, rest in zip(states, first_ids, host_list(codes)):
            st.frames.append([c0] + rest)
        # index_select copies out of the graph's static outputs (the next replay overwrites them)
        idx = batch.logits_indices
        return self._sample(chunks, batch.sample_chunk_ids, hidden.index_select(0, idx), logits.index_select(0, idx))

    def _fused_decode(self, meta: AttentionMetadata, first: torch.Tensor, positions: torch.Tensor, *,
                      past_hidden: torch.Tensor, text: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor, greedy_only: bool = False):
        """codebooks 1..G-1 ``[B, G-1]``, talker hidden ``[B, H]``, suppressed float32 logits ``[B, V]`` of B decode
        rows (``greedy_only``: every row's code predictor is greedy). Capturable: tensor ops only, launches
        independent of the values."""
        m = self.model
        codes = self.cp.loop(past_hidden, first, RowSampling(temperature, top_k, top_p, greedy), uniforms,
                             greedy_only=greedy_only)
        embeds = m.frame_embed(torch.cat([first[:, None], codes], dim=1)) + text
        hidden = m.talker(None, positions, meta, inputs_embeds=embeds)
        logits = m.talker.compute_logits(hidden)
        logits.index_fill_(1, self._suppress, float("-inf"))
        return codes, hidden, logits

    def _graph_step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, *, greedy_only: bool,
                    **extra: torch.Tensor):
        meta = decode_metadata(slot_mapping, block_tables, context_lens, self.block_size, self._torch_views)
        return self._fused_decode(meta, input_ids, positions, greedy_only=greedy_only, **extra)

    def _capture_decode(self, max_num_seqs: int, greedy_only: bool) -> CudaGraphDecoder:
        """Capture the fused step per bucket. Padding rows: greedy code sampling on finite inputs, their K/V
        stored nowhere (Triton, slot -1) or in the spare block past the pool (torch attention)."""
        from strataserve.runner.model_runner import _GRAPH_TORCH_MAX_TOKENS

        m = self.model
        cfg, dev, n = m.config, m.device, max_num_seqs
        h = cfg.talker.hidden_size
        extra = dict(past_hidden=torch.zeros(n, h, dtype=m.dtype, device=dev),
                     text=torch.zeros(n, h, dtype=m.dtype, device=dev),
                     temperature=torch.ones(n, device=dev),
                     top_k=torch.full((n,), cfg.code_predictor.vocab_size, dtype=torch.long, device=dev),
                     top_p=torch.ones(n, device=dev), greedy=torch.ones(n, dtype=torch.bool, device=dev),
                     uniforms=torch.zeros(n, cfg.num_code_groups - 1, device=dev))
        cols = -(-self.max_model_len // self.block_size)
        pad_slot = -1
        if self._torch_views:  # torch attention gathers every captured column: bound the width as the LLM does
            cols = min(cols, -(-_GRAPH_TORCH_MAX_TOKENS // self.block_size))
            pad_slot = self.num_blocks * self.block_size
        m.talker.ops.attention.bind_kv_cache(self.kv_caches)
        step = functools.partial(self._graph_step, greedy_only=greedy_only)
        graphs = CudaGraphDecoder(step, max_num_seqs, cols, dev, pad_slot=pad_slot, extra=extra)
        graphs.capture()
        return graphs

    def _drop_released(self, scheduled: set[str]) -> None:
        keep = []
        while self._released:
            rid = self._released.popleft()
            if rid in scheduled:
                keep.append(rid)
            else:
                self.states.pop(rid, None)
        self._released.extend(keep)

    def _complete_frames(self, chunks) -> None:
        """Run the code predictor for every scheduled position whose frame lacks codebooks 1..G-1."""
        need: list[TTSRequestState] = []
        for c in chunks:
            st = self.states[c.req_id]
            end = c.start_pos + len(c.token_ids)
            if end - 1 - st.prompt.length == len(st.frames):  # the newest codebook-0 id is in this chunk
                need.append(st)
        if not need:
            return
        dev = self.model.device
        first = [st.sampling.output_token_ids[len(st.frames)] for st in need]  # type: ignore[union-attr]
        hidden = torch.stack([st.past_hidden for st in need])  # type: ignore[misc]
        codes = host_list(self.cp.run(hidden, torch.tensor(first, device=dev), self._row_sampling(need),
                                      self._uniforms(need)))
        for st, c0, rest in zip(need, first, codes):
            st.frames.append([c0] + rest)

    def _row_sampling(self, states: list[TTSRequestState]) -> RowSampling:
        dev, vocab = self.model.device, self.model.config.code_predictor.vocab_size
        cs = [s.code_sampling for s in states]
        return RowSampling(
            temperature=torch.tensor([c.temperature for c in cs], dtype=torch.float32, device=dev),
            top_k=torch.tensor([c.top_k if 0 < c.top_k < vocab else vocab for c in cs], device=dev),
            top_p=torch.tensor([c.top_p for c in cs], dtype=torch.float32, device=dev),
            greedy=torch.tensor([c.greedy for c in cs], device=dev))

    def _uniforms(self, states: list[TTSRequestState]) -> torch.Tensor:
        """[B, G-1]: seeded rows from (seed, codebook, frame) so they never depend on the batch; others random."""
        g = self.model.config.num_code_groups - 1
        u = torch.rand(len(states), g)
        for i, st in enumerate(states):
            seed = st.params.seed
            if seed is not None:
                frame = len(st.frames)
                u[i] = torch.tensor([uniform(row_seed(seed, 1 + j), frame) for j in range(g)])
        return u.to(self.model.device)

    def _decode_rows(self, chunks) -> torch.Tensor:
        """Input rows of one-token chunks, batched (the common decode step: one embedding op for all rows)."""
        rows, frames, texts = [], [], []
        for c in chunks:
            st = self.states[c.req_id]
            k = c.start_pos - st.prompt.length
            if k < 0:  # a one-token prompt piece (chunked prefill)
                rows.append(len(frames))
                frames.append(None)
                texts.append(st.prompt.embeds[c.start_pos])
            else:
                frames.append(st.frames[k])
                texts.append(st.prompt.text_row(k))
        text = torch.stack(texts)
        if not rows:
            return self.model.frame_embed(torch.tensor(frames, device=self.model.device)) + text
        out = text.clone()
        real = [i for i, f in enumerate(frames) if f is not None]
        if real:
            codes = torch.tensor([frames[i] for i in real], device=self.model.device)
            idx = torch.tensor(real, device=self.model.device)
            out[idx] = self.model.frame_embed(codes) + text[idx]
        return out

    def _rows_for(self, chunk) -> torch.Tensor:
        """Input rows ``[n, H]`` of one chunk's positions (prompt rows, then frames + text rows)."""
        st = self.states[chunk.req_id]
        p = st.prompt.length
        start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
        parts = []
        if start < p:
            parts.append(st.prompt.embeds[start:min(end, p)])
        if end > p:
            k0, k1 = max(start, p) - p, end - p
            frames = torch.tensor(st.frames[k0:k1], device=self.model.device)
            text = torch.stack([st.prompt.text_row(k) for k in range(k0, k1)])
            parts.append(self.model.frame_embed(frames) + text)
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0].clone()

    def shutdown(self) -> None:
        for graphs in (self.graphs, self.greedy_graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.greedy_graphs = None
        self.model.talker.ops.attention.bind_kv_cache([])
        self.model.predictor.ops.attention.bind_kv_cache([])
        self.kv_caches = []
        self.states.clear()
