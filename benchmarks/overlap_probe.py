"""Does splitting a decode step's batch in two halves on two CUDA streams overlap the halves' work? (H200 probe)

A decode step's KV reads (decode attention, bandwidth-bound) and its small matmuls (latency-bound at these row
counts: ~5-8 us per launch whatever the batch, docs/performance.md run 13) use the GPU differently. Run as two
half-batches on two streams, one half's attention could run beside the other half's matmuls (NanoFlow's
intra-device overlap; Zhu et al., "NanoFlow: Towards Optimal Large Language Model Serving Throughput", 2024).
This probe measures the upside before any runner change: a model-shaped decode step (per layer: add + RMSNorm,
qkv, decode attention over a paged cache, o, add + RMSNorm, gate_up, SiLU-mul, down; then the final norm, lm_head
and argmax), random bf16 weights per layer and caches per layer, replayed in one CUDA graph:

- ``one``: the whole batch on one stream (today's step, minus rotary + KV store and the sampler's copies);
- ``halves_serial``: the two halves one after the other on one stream (the cost of splitting, no overlap);
- ``halves_two_streams``: each half on its own stream, forked and joined inside the graph;
- ``halves_offset``: the same, the second half starting after the first half's first attention.

Halves take alternate rows of the length-sorted batch, so both see the same length mix. One JSON line per
(case, round); rounds alternate the variants' order.

    python benchmarks/overlap_probe.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels_bench as kb  # noqa: E402

from strataserve.kernels.activation import silu_and_mul  # noqa: E402
from strataserve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from strataserve.kernels.rms_norm import fused_add_rms_norm  # noqa: E402
from strataserve.runner.triton_ops import decode_launch  # noqa: E402

DT = torch.bfloat16
SHAPES = {  # hidden, q heads, kv heads, intermediate, layers, vocab
    "qwen3_0.6b": (1024, 16, 8, 3072, 28, 151936),
    "llama_8b": (4096, 32, 8, 14336, 32, 128256),
}
_RNG = random.Random(0)
CASES = {  # name: (shape, context lengths)
    "0.6b_b256_mixed": ("qwen3_0.6b", sorted(_RNG.randint(100, 2048) for _ in range(256))),
    "0.6b_b128_mixed": ("qwen3_0.6b", sorted(_RNG.randint(100, 2048) for _ in range(128))),
    "8b_b64_ctx576": ("llama_8b", [576] * 64),
}


class Half:
    """A batch (or half of one): per-layer caches, block tables, lengths and a semaphore buffer. ``rows`` of a
    parent batch share its caches (one pool, as in the runner)."""

    def __init__(self, lens: list[int], hkv: int, layers: int, bs: int = 16, d: int = 128) -> None:
        blocks = [-(-n // bs) for n in lens]
        need = sum(blocks)
        self.caches = [(torch.randn(need + 1, bs, hkv, d, dtype=DT, device="cuda"),
                        torch.randn(need + 1, bs, hkv, d, dtype=DT, device="cuda")) for _ in range(layers)]
        perm = torch.randperm(need, device="cuda").to(torch.int32)
        self.tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
        at = 0
        for i, nb in enumerate(blocks):
            self.tables[i, :nb] = perm[at:at + nb]
            at += nb
        self.ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.sems = torch.zeros(max(len(lens) * hkv, 4096), dtype=torch.int32, device="cuda")
        self.rows = len(lens)

    def take(self, rows: slice) -> "Half":
        h = object.__new__(Half)
        h.caches, h.tables, h.ctx = self.caches, self.tables[rows].contiguous(), self.ctx[rows].contiguous()
        h.sems = torch.zeros_like(self.sems)  # each stream its own: the adaptive kernel's tickets
        h.rows = int(h.ctx.shape[0])
        return h


def make_weights(shape: str):
    h, hq, hkv, inter, layers, vocab = SHAPES[shape]
    d = 128

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, dtype=DT, device="cuda") * k ** -0.5

    per_layer = [dict(qkv=w((hq + 2 * hkv) * d, h), o=w(h, hq * d), gate_up=w(2 * inter, h), down=w(h, inter),
                      n1=torch.ones(h, dtype=DT, device="cuda"), n2=torch.ones(h, dtype=DT, device="cuda"))
                 for _ in range(layers)]
    return per_layer, w(vocab, h), torch.ones(h, dtype=DT, device="cuda")


def layer(x: torch.Tensor, res: torch.Tensor, lw: dict, half: Half, li: int, hq: int, hkv: int, sms: int):
    """One decoder layer on ``half``'s rows; x/res updated (returns the new x)."""
    d = 128
    x, res = fused_add_rms_norm(x, res, lw["n1"], 1e-6)
    qkv = F.linear(x, lw["qkv"])
    q = qkv[:, :hq * d].reshape(-1, hq, d)
    splits, target = decode_launch(half.rows, hkv, sms, 16, 6)
    kc, vc = half.caches[li]
    att = paged_decode_attention(q.contiguous(), kc, vc, half.tables, half.ctx, d ** -0.5, num_splits=splits,
                                 reverse=True, split_target=target, num_sms=sms,
                                 semaphores=half.sems if target else None)
    x = F.linear(att.reshape(-1, hq * d), lw["o"])
    x, res = fused_add_rms_norm(x, res, lw["n2"], 1e-6)
    x = F.linear(silu_and_mul(F.linear(x, lw["gate_up"])), lw["down"])
    return x, res


def step_fn(variant: str, shape: str, weights, full: Half, halves: tuple[Half, Half], xs: dict, sms: int):
    per_layer, lm_head, norm = weights
    _, hq, hkv, _, layers, _ = SHAPES[shape]
    side = torch.cuda.Stream()

    def run(half: Half, x: torch.Tensor, res: torch.Tensor, after_first_attention=None):
        for li in range(layers):
            x, res = layer(x, res, per_layer[li], half, li, hq, hkv, sms)
            if li == 0 and after_first_attention is not None:
                after_first_attention.record()
        return x, res

    def fn():
        if variant == "one":
            x, res = run(full, xs["x"].clone(), xs["res"].clone())
        elif variant == "halves_serial":
            a = run(halves[0], xs["xa"].clone(), xs["ra"].clone())
            b = run(halves[1], xs["xb"].clone(), xs["rb"].clone())
            x, res = torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])
        else:
            first = torch.cuda.Event() if variant == "halves_offset" else None
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            xa, ra = xs["xa"].clone(), xs["ra"].clone()
            with torch.cuda.stream(side):
                xb, rb = xs["xb"].clone(), xs["rb"].clone()
            a_out = run(halves[0], xa, ra, first)
            with torch.cuda.stream(side):
                if first is not None:
                    side.wait_event(first)
                b_out = run(halves[1], xb, rb)
            main.wait_stream(side)
            x, res = torch.cat([a_out[0], b_out[0]]), torch.cat([a_out[1], b_out[1]])
        x, _ = fused_add_rms_norm(x, res, norm, 1e-6)
        return F.linear(x, lm_head).argmax(dim=-1)

    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    variants = ["one", "halves_serial", "halves_two_streams", "halves_offset"]
    for name in args.cases.split(","):
        shape, lens = CASES[name]
        h, hq, hkv, _, layers, _ = SHAPES[shape]
        weights = make_weights(shape)
        full = Half(lens, hkv, layers)
        halves = (full.take(slice(0, None, 2)), full.take(slice(1, None, 2)))
        B = len(lens)
        xs = {"x": torch.randn(B, h, dtype=DT, device="cuda"), "res": torch.randn(B, h, dtype=DT, device="cuda")}
        xs.update(xa=xs["x"][0::2].contiguous(), ra=xs["res"][0::2].contiguous(),
                  xb=xs["x"][1::2].contiguous(), rb=xs["res"][1::2].contiguous())
        fns = {v: step_fn(v, shape, weights, full, halves, xs, sms) for v in variants}
        # the split must not change the math: the halves' tokens equal the full batch's (rows interleaved)
        torch.cuda.synchronize()
        want = fns["one"]()
        got = fns["halves_two_streams"]()
        torch.cuda.synchronize()
        agree = float((torch.cat([want[0::2], want[1::2]]) == got).float().mean())
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            row: dict = {"bench": "overlap_probe", "case": name, "round": r + 1, "rows": B,
                         "mean_ctx": round(sum(lens) / B), "tokens_agree": round(agree, 4)}
            for v in order:
                row[f"{v}_ms"] = round(kb._graph_t([fns[v]], reps=20) * 1e3, 3)
            row["gain_two_streams"] = round(row["one_ms"] / row["halves_two_streams_ms"], 3)
            row["gain_offset"] = round(row["one_ms"] / row["halves_offset_ms"], 3)
            print(json.dumps(row), flush=True)
        del weights, full, halves, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
