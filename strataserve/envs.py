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
#: at start-up, time cuBLAS against the Triton GEMV per weight shape for batch-1 matmuls and keep the faster.
STRATA_GEMV_TUNE: bool = os.environ.get("STRATA_GEMV_TUNE", "1") != "0"
#: decode attention launches the longest rows first, with ~16 programs per SM (more KV splits) instead of ~2.
STRATA_DECODE_LONG_FIRST: bool = os.environ.get("STRATA_DECODE_LONG_FIRST", "1") != "0"
#: greedy argmax inside the captured decode graph (all-greedy steps skip the logits gather and the sampler).
STRATA_GRAPH_ARGMAX: bool = os.environ.get("STRATA_GRAPH_ARGMAX", "1") != "0"
#: "0": CPU attention gathers K/V through the block tables and runs SDPA (the path before the C kernel of
#: ``runner/cpu_paged_attention.c``, which reads the blocks in place; the benchmarks' "before" and an escape hatch).
STRATA_CPU_ATTENTION: bool = os.environ.get("STRATA_CPU_ATTENTION", "1") != "0"
#: where compiled CPU kernels are kept (one file per source, compiler and CPU).
STRATA_KERNEL_CACHE: str = os.environ.get("STRATA_KERNEL_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "strataserve", "kernels")

# libgomp's default ACTIVE wait policy makes torch's CPU worker threads spin between parallel regions. When the
# cores are shared (engine process, API process and clients on one small machine, or any other job) the spinning
# threads steal the very cores the work needs: on the 2-core CI machine the offline benchmark fell from ~1,950 to
# ~215 tok/s with one other busy process. PASSIVE costs little when the machine is idle (docs/performance.md).
_PROCESS_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_process_defaults() -> None:
    """Set our defaults for variables the user has not set (theirs always win)."""
    for key, value in _PROCESS_DEFAULTS.items():
        os.environ.setdefault(key, value)
