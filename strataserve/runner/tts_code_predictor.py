"""The code predictor's per-frame inner loop, for a whole batch of frames at once.

For B frames (one per request that needs one this step), given the talker's last hidden state and codebook 0:
position 0 takes the projected hidden state, position 1 the projected codebook-0 embedding, position j >= 2 the
projected embedding of codebook j-1; the output at position j (j >= 1) gives codebook j through head j. That is
G decoder steps of one token per row over a small KV cache that lives only for this frame: row b uses block b,
so the attention metadata depends on B alone (on CUDA the loop is captured as one graph per batch bucket).

Sampling (``sample_rows``) is pure tensor code: temperature, top-k, top-p, then an inverse-CDF draw with one
uniform per row given by the caller (seeded requests get theirs from (seed, frame, codebook), so their codes do
not depend on the batch); greedy rows take the argmax of the raw logits, as the reference's greedy generate does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strataserve.models.qwen3_tts.talker import Qwen3TTSTalker
from strataserve.runner.attention import TorchAttention, allocate_kv_cache
from strataserve.runner.cuda_graph import decode_metadata


@dataclass
class RowSampling:
    """Per-row sampling settings as tensors ``[B]`` (float32 / int64 / bool) on the model's device."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # vocab size = off
    top_p: torch.Tensor
    greedy: torch.Tensor


def sample_rows(logits: torch.Tensor, s: RowSampling, u: torch.Tensor) -> torch.Tensor:
    """logits float32 ``[B, V]``, uniforms ``u`` ``[B]`` in [0, 1) -> token ids ``[B]`` (no host sync)."""
    greedy_tok = logits.argmax(dim=-1)
    x = logits / s.temperature.clamp(min=1e-5)[:, None]
    vals, idx = x.sort(dim=-1, descending=True)
    ranks = torch.arange(x.shape[1], device=x.device)[None, :]
    keep = ranks < s.top_k[:, None]
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep &= (probs.cumsum(dim=-1) - probs) < s.top_p[:, None]
    probs = torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=x.shape[1] - 1)
    sampled = idx.gather(1, pick).squeeze(1)
    return torch.where(s.greedy, greedy_tok, sampled)


class CodePredictorLoop:
    """Runs the inner loop for up to ``max_bs`` rows; owns the code predictor's per-frame KV cache."""

    def __init__(self, model: Qwen3TTSTalker, max_bs: int) -> None:
        self.model = model
        cfg = model.config.code_predictor
        self.groups = model.config.num_code_groups
        self.block_size = self.groups  # one block holds a whole frame's G positions
        self.max_bs = max_bs
        self.kv = allocate_kv_cache(cfg.num_layers, max_bs, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                    model.dtype, model.device)
        self._torch_views = isinstance(model.predictor.ops.attention, TorchAttention)
        self._graphs: dict[int, tuple] = {}  # bucket -> (graph, input buffers, output)

    @torch.inference_mode()
    def run(self, past_hidden: torch.Tensor, first: torch.Tensor, sampling: RowSampling,
            uniforms: torch.Tensor) -> torch.Tensor:
        """past_hidden ``[B, H]`` (talker width), first ``[B]`` codebook-0 ids, uniforms ``[B, G-1]`` ->
        codebooks 1..G-1 ``[B, G-1]`` (long). Replays a captured graph when one covers B."""
        b = past_hidden.shape[0]
        if b > self.max_bs:
            raise ValueError(f"code predictor batch {b} exceeds its capacity {self.max_bs}")
        bucket = next((n for n in sorted(self._graphs) if n >= b), None)
        if bucket is None:
            return self.loop(past_hidden, first, sampling, uniforms)
        graph, ins, out = self._graphs[bucket]
        for buf, src in zip(ins, (past_hidden, first, sampling.temperature, sampling.top_k, sampling.top_p,
                                  sampling.greedy, uniforms)):
            buf[:b].copy_(src)
        graph.replay()
        return out[:b].clone()

    def capture(self, sizes: list[int]) -> None:
        """Capture the whole inner loop (G decoder steps + sampling) once per batch bucket (CUDA only). Padding
        rows of a bucket run greedily on zero inputs in their own KV blocks and are dropped."""
        m = self.model
        dev = m.device
        vocab = m.config.code_predictor.vocab_size
        pool = None
        for bs in sorted((n for n in sizes if n <= self.max_bs), reverse=True):
            ins = (torch.zeros(bs, m.config.talker.hidden_size, dtype=m.dtype, device=dev),
                   torch.zeros(bs, dtype=torch.long, device=dev), torch.ones(bs, device=dev),
                   torch.full((bs,), vocab, dtype=torch.long, device=dev), torch.ones(bs, device=dev),
                   torch.ones(bs, dtype=torch.bool, device=dev), torch.zeros(bs, self.groups - 1, device=dev))

            def loop() -> torch.Tensor:
                return self.loop(ins[0], ins[1], RowSampling(*ins[2:6]), ins[6])

            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side), torch.inference_mode():
                loop()  # warm-up: kernel compilation and allocator growth happen outside the capture
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                out = loop()
            pool = graph.pool()
            self._graphs[bs] = (graph, ins, out)

    def loop(self, past_hidden: torch.Tensor, first: torch.Tensor, sampling: RowSampling,
             uniforms: torch.Tensor, greedy_only: bool = False) -> torch.Tensor:
        """The inner loop itself (capturable: no host sync); ``run`` replays it, the talker's fused step embeds it.
        ``greedy_only``: every row is greedy, so the argmax alone picks each code (what ``sample_rows`` keeps for
        greedy rows, without its sampling pipeline)."""
        m = self.model
        b = past_hidden.shape[0]
        dev = past_hidden.device
        m.predictor.ops.attention.bind_kv_cache(self.kv)  # per call: runners may share the model
        rows = torch.arange(b, device=dev)
        tables = rows.to(torch.int32)[:, None]
        codes = []
        x = m.cp_input(past_hidden).clone()  # the decoder may reuse its input's storage (fused add + norm)
        for j in range(self.groups):
            ctx = torch.full((b,), j + 1, dtype=torch.int32, device=dev)
            meta = decode_metadata(rows * self.block_size + j, tables, ctx, self.block_size, self._torch_views)
            pos = torch.full((b,), j, dtype=torch.long, device=dev)
            hidden = m.predictor(None, pos, meta, inputs_embeds=x)
            if j == 0:
                x = m.cp_input(m.codec_embed(first))
                continue
            logits = m.cp_logits(j, hidden)
            tok = logits.argmax(dim=-1) if greedy_only else sample_rows(logits, sampling, uniforms[:, j - 1])
            codes.append(tok)
            if j + 1 < self.groups:
                x = m.cp_input(m.cp_code_embed(j, tok))
        return torch.stack(codes, dim=1)
