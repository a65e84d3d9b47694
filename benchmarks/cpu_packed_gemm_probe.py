"""MKL's packed GEMM (the engine's opt-in ``STRATA_CPU_PACKED_WEIGHTS``) against ``F.linear``, one thread,
decode-sized rows.

``F.linear`` (and the engine's pool, which calls the same ``sgemm_`` per tile) makes MKL pack the weight again on
every call; with few rows that copy is a large share of the work (``perf``: ~30% of a Qwen3-0.6B-shaped decode step
at 32 sequences in ``mkl_blas_avx512_sgemm_scopy_right48_ea``). ``cblas_sgemm_pack`` (exported by libtorch_cpu)
packs the weight once; ``cblas_sgemm_compute`` then multiplies. Per weight shape and row count, both warmed up,
timed over ``--reps`` calls, alternating which goes first per round. One line per (round, shape, rows):

    round=1 n=4096 k=1024 m=32 linear_ms=... packed_ms=... ratio=... identical=False max_abs_diff=...

    python benchmarks/cpu_packed_gemm_probe.py --rounds 3
"""
from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX = 101, 111, 112, 151, 162
SHAPES = [(4096, 1024), (3072, 1024), (1024, 3072), (37984, 1024)]  # Qwen3-0.6B's qkv, up, down, a lm_head quarter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    tl = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    i, f, v = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    tl.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    tl.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
    tl.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, v, i, v]
    tl.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, v, i, v, i, f, v, i]
    gen = torch.Generator().manual_seed(0)
    for r in range(1, args.rounds + 1):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=gen)
            packed = torch.empty(tl.cblas_sgemm_pack_get_size(B_MATRIX, 64, n, k) // 4 + 16)
            tl.cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, TRANS, 64, n, k, 1.0, w.data_ptr(), k, packed.data_ptr())
            for m in (1, 8, 32, 64):
                x, y = torch.randn(m, k, generator=gen), torch.empty(m, n)

                def run_packed() -> None:
                    tl.cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, m, n, k, x.data_ptr(), k, packed.data_ptr(),
                                           k, 0.0, y.data_ptr(), n)

                sides = {"linear": lambda: F.linear(x, w), "packed": run_packed}
                ms = {}
                for name in (list(sides) if r % 2 else list(sides)[::-1]):
                    sides[name]()
                    t = time.perf_counter()
                    for _ in range(args.reps):
                        sides[name]()
                    ms[name] = (time.perf_counter() - t) / args.reps * 1e3
                run_packed()
                ref = F.linear(x, w)
                print(f"round={r} n={n} k={k} m={m} linear_ms={ms['linear']:.2f} packed_ms={ms['packed']:.2f} "
                      f"ratio={ms['packed'] / ms['linear']:.2f} identical={torch.equal(y, ref)} "
                      f"max_abs_diff={(y - ref).abs().max().item():.1e}", flush=True)


if __name__ == "__main__":
    main()
