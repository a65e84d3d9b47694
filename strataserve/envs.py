"""Every environment variable strataserve reads, typed, in one place.

Read once at start-up; nothing here changes afterwards. ``apply_process_defaults`` runs when the package is
imported, before torch loads its OpenMP runtime (which reads OMP_* only once).
"""
from __future__ import annotations

import os

#: ``Authorization: Bearer`` key required by ``strata serve`` when no ``--api-key`` is given.
STRATA_API_KEY: str | None = os.environ.get("STRATA_API_KEY")
#: "0" turns off async scheduling on CUDA (step N+1 launched before step N's tokens reach the host).
STRATA_ASYNC_SCHEDULING: bool = os.environ.get("STRATA_ASYNC_SCHEDULING", "1") != "0"
# GPU optimisations of issue 12 (docs/gpu_notes.md, run 6), each on by default; "0" restores the earlier path
# (the benchmarks' before/after switch, and an escape hatch):
#: (q/k norm,) rotary and the KV store in one Triton kernel per layer.
STRATA_FUSED_ROPE_KV: bool = os.environ.get("STRATA_FUSED_ROPE_KV", "1") != "0"
#: in decode-only steps with a float cache, that rotary and KV store run inside the decode-attention kernel (run 18).
STRATA_DECODE_ROPE_IN_ATTENTION: bool = os.environ.get("STRATA_DECODE_ROPE_IN_ATTENTION", "1") != "0"
#: ... for decode steps of up to this many rows (batch 1 always: run 18; larger steps with PDL: run 21).
STRATA_DECODE_ROPE_MAX_ROWS: int = int(os.environ.get("STRATA_DECODE_ROPE_MAX_ROWS", "1"))
if STRATA_DECODE_ROPE_MAX_ROWS < 1:
    raise ValueError(f"STRATA_DECODE_ROPE_MAX_ROWS={STRATA_DECODE_ROPE_MAX_ROWS}: must be >= 1 "
                     "(STRATA_DECODE_ROPE_IN_ATTENTION=0 turns it off)")
#: at start-up, time cuBLAS against the Triton GEMV per weight shape for batch-1 matmuls and keep the faster.
STRATA_GEMV_TUNE: bool = os.environ.get("STRATA_GEMV_TUNE", "1") != "0"
#: at start-up, time cuBLAS against the few-rows Triton GEMM per weight shape for decode matmuls of 2-64 rows (run 19).
STRATA_GEMM_TUNE: bool = os.environ.get("STRATA_GEMM_TUNE", "1") != "0"


def _row_classes(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(r) for r in text.split(","))
    except ValueError:
        rows = ()
    if not rows or rows[0] < 2 or any(b <= a for a, b in zip(rows, rows[1:])):
        raise ValueError(f"STRATA_GEMM_ROWS={text!r}: use increasing row counts >= 2, comma-separated (e.g. 16,64)")
    return rows


#: ... the row classes it times: a step of r rows takes the plan of the smallest class >= r; larger steps keep cuBLAS.
STRATA_GEMM_ROWS: tuple[int, ...] = _row_classes(os.environ.get("STRATA_GEMM_ROWS", "16,64"))
#: ... and gate_up with the SiLU-and-mul as its epilogue against that matmul + the activation's own launch (run 20).
STRATA_GEMM_SILU: bool = os.environ.get("STRATA_GEMM_SILU", "1") != "0"
#: the same tuning also times each RMSNorm / SiLU-mul + matmul pair against one GEMV with the op as its prologue.
STRATA_GEMV_PROLOGUE: bool = os.environ.get("STRATA_GEMV_PROLOGUE", "1") != "0"
#: Triton kernels on Hopper+ launch with programmatic dependent launch (``kernels/_common.py``, ``pdl_args``): each
#: kernel's programs are scheduled while the previous kernel drains and wait in-kernel for its results, instead of
#: the launch starting only once it has finished. Issue 12, docs/gpu_notes.md run 18.
STRATA_PDL: bool = os.environ.get("STRATA_PDL", "1") != "0"
#: PDL only for launches over at most this many rows (tokens): decode steps of up to 64 sequences, whose matmuls are
#: our kernels where they were faster (``kernels/_common.py``, run 19); 1 = batch-1 decode only (run 18).
STRATA_PDL_MAX_ROWS: int = int(os.environ.get("STRATA_PDL_MAX_ROWS", "64"))
if STRATA_PDL_MAX_ROWS < 1:
    raise ValueError(f"STRATA_PDL_MAX_ROWS={STRATA_PDL_MAX_ROWS}: must be >= 1 (STRATA_PDL=0 turns PDL off)")
#: with PDL, a batch-1 GEMV's first programs ask L2 for their first weight tiles, and batch-1 decode attention (with
#: the rotary inside) for its first key tile, before they wait for the previous kernel (run 18).
STRATA_PDL_PREFETCH: bool = os.environ.get("STRATA_PDL_PREFETCH", "1") != "0"
#: decode attention launches the longest rows first, with ~16 programs per SM (more KV splits) instead of ~2.
STRATA_DECODE_LONG_FIRST: bool = os.environ.get("STRATA_DECODE_LONG_FIRST", "1") != "0"
#: decode attention's launch configuration chosen per launch regime (``runner/triton_ops.decode_config``, run
#: 21); "0": run 6's (64-key tiles, 4 warps, 2 stages) for every launch.
STRATA_DECODE_ATTN_CONFIGS: bool = os.environ.get("STRATA_DECODE_ATTN_CONFIGS", "1") != "0"
#: decode attention chooses each row's KV split count in the kernel from its own length against the step's total,
#: aiming at this many programs per SM, and combines the splits in the kernel (no reduce launch); "0": the split
#: count is fixed per batch size (run 6's launch). Issue 12, docs/gpu_notes.md run 8.
STRATA_DECODE_SPLIT_TARGET: int = int(os.environ.get("STRATA_DECODE_SPLIT_TARGET", "6"))
if STRATA_DECODE_SPLIT_TARGET < 0:
    raise ValueError(f"STRATA_DECODE_SPLIT_TARGET={STRATA_DECODE_SPLIT_TARGET}: use 0 (off) or a positive count")
#: steps with prompt tokens replay CUDA graphs per token bucket, captured on first use (hybrid runner, one rank;
#: ``runner/mixed_graph.py``); "0": they run eagerly. Issue 12, docs/gpu_notes.md run 9.
STRATA_MIXED_GRAPHS: bool = os.environ.get("STRATA_MIXED_GRAPHS", "1") != "0"
#: prefill chunks one mixed-step graph takes (a step with more runs eagerly)
STRATA_MIXED_GRAPH_MAX_PREFILLS: int = int(os.environ.get("STRATA_MIXED_GRAPH_MAX_PREFILLS", "32"))
if STRATA_MIXED_GRAPH_MAX_PREFILLS < 1:
    raise ValueError(f"STRATA_MIXED_GRAPH_MAX_PREFILLS={STRATA_MIXED_GRAPH_MAX_PREFILLS}: must be >= 1")
#: greedy argmax inside the captured decode graph (all-greedy steps skip the logits gather and the sampler).
STRATA_GRAPH_ARGMAX: bool = os.environ.get("STRATA_GRAPH_ARGMAX", "1") != "0"
#: how the sampler finds top-p cut-offs on accelerators: "kernel" (default): each row searched without sorting it
#: (``kernels/top_p.py``; run 31 on the H200: 3.6x faster than the sort at 256 x 151,936, top-p decode +27%);
#: "sort": a full sort of every row, the earlier path, kept as the fallback and the A/B control.
STRATA_TOP_P: str = os.environ.get("STRATA_TOP_P", "kernel")
if STRATA_TOP_P not in ("kernel", "sort"):
    raise ValueError(f"STRATA_TOP_P={STRATA_TOP_P!r}: use 'kernel' or 'sort'")
#: how the sampler computes token logprobs on accelerators: "kernel" (default): one read of each row for the chosen
#: token's log-prob, rank and the top n (``kernels/token_logprobs.py``); "torch": log_softmax + gather + rank count
#: + topk over a full copy, the earlier path, kept as the A/B control.
STRATA_LOGPROBS: str = os.environ.get("STRATA_LOGPROBS", "kernel")
if STRATA_LOGPROBS not in ("kernel", "torch"):
    raise ValueError(f"STRATA_LOGPROBS={STRATA_LOGPROBS!r}: use 'kernel' or 'torch'")
#: tensor parallelism on CUDA: "symm_mem" sums small activations (decode steps) with PyTorch's one-shot
#: symmetric-memory all-reduce (peer loads over NVLink, no multicast) instead of NCCL's; "nccl" (default): NCCL only.
STRATA_TP_ALLREDUCE: str = os.environ.get("STRATA_TP_ALLREDUCE", "nccl")
#: on a GPU, checkpoint tensors go from the file to the parameters through pinned buffers, several reads in flight
#: (``models/weight_stream.py``); "0": every tensor through safetensors' memory map and a pageable copy.
STRATA_WEIGHT_STREAM: bool = os.environ.get("STRATA_WEIGHT_STREAM", "1") != "0"
#: ``strata serve`` spawns the engine process before its own heavy imports and loads the tokenizer while the engine
#: loads (issue 12 item 3); "0": one after the other, as before (the start-up benchmark's "before" switch).
STRATA_SERVE_EARLY_SPAWN: bool = os.environ.get("STRATA_SERVE_EARLY_SPAWN", "1") != "0"
#: ``strata serve`` captures a few decode CUDA graphs before it is ready and the other buckets while the engine
#: idles (``RunnerConfig.defer_cuda_graphs``, run 21); "0": every bucket before ready.
STRATA_SERVE_DEFER_GRAPHS: bool = os.environ.get("STRATA_SERVE_DEFER_GRAPHS", "1") != "0"
#: "0": leave the start-up heap in the garbage collector's generations (``startup.freeze_startup_heap``: the API
#: process, the engine core and tensor-parallel worker ranks freeze it once ready, so full collections skip it;
#: the offline ``LLM`` sets it aside while a generate loop runs, ``startup.heap_set_aside``).
STRATA_GC_FREEZE: bool = os.environ.get("STRATA_GC_FREEZE", "1") != "0"
#: a file the engine core appends one line to per step: "wall-time decodes prefill-tokens device-ms" (the load
#: benchmarks' breakdown, ``benchmarks/serve_load_gpu.py``); unset: no log.
STRATA_STEP_LOG: str | None = os.environ.get("STRATA_STEP_LOG") or None
#: "0": CPU attention gathers K/V through the block tables and runs SDPA (the path before the C kernel of
#: ``runner/cpu_paged_attention.c``, which reads the blocks in place; the benchmarks' "before" and an escape hatch).
STRATA_CPU_ATTENTION: bool = os.environ.get("STRATA_CPU_ATTENTION", "1") != "0"
#: "0": the CPU engine's residual add, RMSNorm, rotary, K/V store and SiLU-and-mul run as PyTorch ops, not as the
#: single C calls of ``runner/cpu_layer_ops.c`` (the benchmarks' "before" and an escape hatch).
STRATA_CPU_LAYER_OPS: bool = os.environ.get("STRATA_CPU_LAYER_OPS", "1") != "0"
#: "0": the CPU engine's matmuls and C kernels run on torch's OpenMP threads instead of the work-sharing pool of
#: ``runner/cpu_pool.py`` (whose caller never waits for a thread that another process keeps off its core).
STRATA_CPU_POOL: bool = os.environ.get("STRATA_CPU_POOL", "1") != "0"
#: "1": the pool's float32 matmuls of 2-256 rows run on weights packed once by MKL (``cblas_sgemm_pack``) instead of
#: packed again on every call: 0.35-0.84 of the time at 8-64 rows for a 0.6B-class model's shapes, but the results
#: are no longer bit-identical to ``F.linear`` and each packed weight keeps a copy of its size next to the original.
STRATA_CPU_PACKED_WEIGHTS: bool = os.environ.get("STRATA_CPU_PACKED_WEIGHTS", "0") == "1"
#: where compiled CPU kernels (one file per source, compiler and CPU) and the GPU's batch-1 GEMV tuning choices
#: (``runner/tuning_cache.py``, one file per GPU, versions and shapes) are kept; delete it to measure afresh.
STRATA_KERNEL_CACHE: str = os.environ.get("STRATA_KERNEL_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "strataserve", "kernels")

#: threads that fill a step's grammar bitmasks (structured outputs; xgrammar's batch matcher). Unset: 1 for a CPU
#: engine (its other cores run the model), else half the cores, at most 8: with 256 constrained rows of a 151k
#: vocabulary one thread took longer than the forward pass (docs/performance.md, "Structured outputs on the H200").
STRATA_GRAMMAR_THREADS: int | None = int(os.environ["STRATA_GRAMMAR_THREADS"]) if os.environ.get(
    "STRATA_GRAMMAR_THREADS") else None
if STRATA_GRAMMAR_THREADS is not None and STRATA_GRAMMAR_THREADS < 1:
    raise ValueError(f"STRATA_GRAMMAR_THREADS={STRATA_GRAMMAR_THREADS}: must be >= 1")

#: "adaptive" (default): a CPU engine drops a torch thread while its threads wait for a core (other processes keep the
#: cores busy) and tries it again later (``runner/cpu_threads.py``); "fixed": torch's count (``torch.set_num_threads``
#: / OMP_NUM_THREADS).
STRATA_CPU_THREADS: str = os.environ.get("STRATA_CPU_THREADS", "adaptive")
if STRATA_CPU_THREADS not in ("adaptive", "fixed"):
    raise ValueError(f"STRATA_CPU_THREADS={STRATA_CPU_THREADS!r}: use 'adaptive' or 'fixed'")

# OpenMP waiting (measured in docs/performance.md, "CPU threads"). Between two parallel regions a torch worker
# thread either spins or sleeps. Spinning wins while the engine loop is busy on cores nobody else wants (the gaps
# between ops are microseconds; waking a sleeping thread costs more), and loses badly when another process needs
# the core (libgomp's default 300,000 spins collapsed the offline benchmark from ~1,950 to ~215 tok/s next to one
# busy process). So: spin a bounded while (GOMP_SPINCOUNT=10000, ~0.4 ms here: covers the gaps inside a step and
# most between steps, then the threads sleep, so an idle engine burns nothing), and let the thread governor drop a
# thread while the threads wait for cores other processes keep busy. OMP_WAIT_POLICY=ACTIVE (spin forever) would
# keep an idle server's cores busy; PASSIVE (never spin) costs ~25% on an idle machine.
# A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins.
_SPIN_DEFAULT = "10000"


def _process_defaults() -> dict[str, str]:
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": _SPIN_DEFAULT}


def apply_process_defaults() -> None:
    """Set our defaults for variables the user has not set (theirs always win)."""
    for key, value in _process_defaults().items():
        os.environ.setdefault(key, value)
