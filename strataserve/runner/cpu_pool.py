"""``CpuPool``: the CPU engine's work-sharing threads (``cpu_pool.c``) and the float32 matmuls they run.

Why not torch's OpenMP threads: every OpenMP region (MKL's threaded GEMM included) splits its work statically and
ends at a barrier, so behind ``strata serve`` each burst of the API process or a client that displaces one engine
thread stalls the other at the next barrier. In the pool the calling thread runs whatever chunks no worker has
started, so it never waits for a thread that is off its core (docs/performance.md, "A work-sharing pool").

While a CPU engine steps, its matmuls, attention and layer ops run on the pool and torch is held at one thread
(``hold_torch`` / ``release_torch``), so no OpenMP worker spins beside the pool's. The matmuls are MKL's own
``sgemm`` (torch's copy), one single-threaded call per tile of the output: the same kernel on the same operands, so
the results equal ``F.linear``'s bit for bit (tested). ``STRATA_CPU_POOL=0`` keeps torch's threads.

Opt-in, ``STRATA_CPU_PACKED_WEIGHTS=1``: matmuls of 2-256 rows run over each weight packed once by MKL
(``cblas_sgemm_pack``, kept while the weight lives) instead of packed again on every call, which is most of a
decode step's matmul time at a 0.6B-class model's widths. Within float32 rounding of ``F.linear``, not bit for bit,
and each packed weight keeps a copy of its own size.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import weakref
from collections.abc import Iterator

import torch

from strataserve import envs
from strataserve.runner import cpu_kernel

log = logging.getLogger(__name__)

_F32 = torch.float32
# Between jobs a worker spins this long (the gaps inside a step are shorter), offering its core to other runnable
# processes every _YIELD_NS, then sleeps. Measured in docs/performance.md ("A work-sharing pool").
_SPIN_NS = 400_000
_YIELD_NS = 20_000
# Output tiles per thread: two, so that the dynamic hand-out evens out a thread that starts late; each tile is one
# sgemm call that packs its share of both operands again, so more would cost more.
_TILES_PER_THREAD = 2
# With STRATA_CPU_PACKED_WEIGHTS, matmuls of 2 to this many rows use the weights packed once; longer prompts pay
# MKL's own packing over enough rows that it hardly counts.
_PACKED_MAX_ROWS = 256


class CpuPool:
    """The process's pool (``get()``), started once with the thread count torch had then."""

    def __init__(self, lib: ctypes.CDLL, threads: int, sgemm: int) -> None:
        self._lib = lib
        self.threads = threads
        self._sgemm = sgemm
        self._torch_threads: int | None = None  # torch's count while held at one thread
        # STRATA_CPU_PACKED_WEIGHTS: id(weight) -> (a weak reference to it, its packed tiles). Not a
        # WeakKeyDictionary: that compares keys with ==, which a tensor answers elementwise.
        self._packed_weights: dict[int, tuple[weakref.ref, _PackedWeight]] = {}

    @property
    def run_fn(self) -> int:
        """Address of ``strata_pool_run``, for the kernel libraries' ``strata_set_pool``."""
        return ctypes.cast(self._lib.strata_pool_run, ctypes.c_void_p).value  # type: ignore[return-value]

    def hold_torch(self) -> None:
        """Torch at one thread while the engine steps (idempotent)."""
        if self._torch_threads is None:
            self._torch_threads = torch.get_num_threads()
            if self._torch_threads != 1:
                torch.set_num_threads(1)

    def release_torch(self) -> None:
        """Torch's own count back (the engine went idle; an in-process engine shares torch with its caller)."""
        if self._torch_threads is not None:
            if self._torch_threads != 1:
                torch.set_num_threads(self._torch_threads)
            self._torch_threads = None

    @contextlib.contextmanager
    def torch_released(self) -> Iterator[None]:
        """Torch's own thread count inside the block while it is held (the sampler's sort and softmax over a large
        vocabulary are torch ops that gain from every thread), held at one thread again after it."""
        held = self._torch_threads
        if held is None or held == 1:
            yield
            return
        torch.set_num_threads(held)
        try:
            yield
        finally:
            torch.set_num_threads(1)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """``F.linear`` for float32 ``x`` ``[m, k]`` (rows contiguous) and contiguous ``weight`` ``[n, k]`` / ``bias``
        on the pool, or None for anything else (the caller falls back to torch)."""
        if (x.dtype != _F32 or weight.dtype != _F32 or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous()
                or weight.dim() != 2 or weight.shape[1] != x.shape[1] or x.shape[0] == 0
                or (bias is not None and (bias.dtype != _F32 or not bias.is_contiguous()
                                          or bias.shape != (weight.shape[0],)))):
            return None
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, dtype=_F32)
        packing = cpu_kernel.mkl_packing() if envs.STRATA_CPU_PACKED_WEIGHTS and 2 <= m <= _PACKED_MAX_ROWS else None
        packed = None if packing is None else self._packed(weight, packing)
        if packing is not None and packed is not None:
            row_tiles = max(1, _TILES_PER_THREAD * self.threads // len(packed.tiles))
            self._lib.strata_linear_packed(packing.compute, x.data_ptr(), x.stride(0), packed.ptrs,
                                           None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                                           -(-m // row_tiles), packed.nc)
            return y
        mc, nc = tile_shape(m, n, self.threads)
        self._lib.strata_linear(self._sgemm, x.data_ptr(), x.stride(0), weight.data_ptr(),
                                None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k, mc, nc)
        return y

    def _packed(self, weight: torch.Tensor, packing: cpu_kernel.MklPacking) -> _PackedWeight | None:
        """``weight``'s column tiles (a decode step's split) packed once, kept while the tensor lives (weakly keyed:
        nothing is attached to the tensor, so copying or pickling it carries no pointers); packed again if the
        weight was written in place since. None for a tensor that counts no writes (an inference tensor): it would
        have to be packed on every call."""
        version = _version(weight)
        if version is None:
            return None
        entry = self._packed_entry(weight)
        if entry is None or entry.version != version:
            nc = tile_shape(1, weight.shape[0], self.threads)[1]
            tiles = [packing.pack(weight[n0:n0 + nc]) for n0 in range(0, weight.shape[0], nc)]
            entry = _PackedWeight(nc, tiles, (ctypes.c_void_p * len(tiles))(*(t.data_ptr() for t in tiles)), version)
            key, table = id(weight), self._packed_weights
            # the entry goes when the weight does (before its id can be reused)
            table[key] = (weakref.ref(weight, lambda _, k=key: table.pop(k, None)), entry)
        return entry

    def _packed_entry(self, weight: torch.Tensor) -> _PackedWeight | None:
        hit = self._packed_weights.get(id(weight))
        return hit[1] if hit is not None and hit[0]() is weight else None

    def is_packed(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` has a packed copy (it went through the packed route)."""
        return self._packed_entry(weight) is not None


class _PackedWeight:
    __slots__ = ("nc", "tiles", "ptrs", "version")

    def __init__(self, nc: int, tiles: list[torch.Tensor], ptrs: ctypes.Array, version: int | None) -> None:
        self.nc, self.tiles, self.ptrs, self.version = nc, tiles, ptrs, version


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place write counter (None for inference tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def tile_shape(m: int, n: int, threads: int) -> tuple[int, int]:
    """(rows, columns) of the output tiles: about ``_TILES_PER_THREAD`` tiles per thread, cut so that the operands
    MKL packs again for every tile (x's rows of each tile, w's rows of each tile) add up to the fewest values: a
    decode step's few rows are split by columns only, a long prompt's also by rows. Columns in multiples of 16."""
    tiles = _TILES_PER_THREAD * max(threads, 1)
    splits = [r for r in range(1, min(tiles, m) + 1) if tiles % r == 0]  # 1 is always there
    # values packed: all of w's rows once per row block, all of x's rows once per column block
    row_splits = min(splits, key=lambda r: r * n + (tiles // r) * m)
    col_splits = tiles // row_splits
    mc = -(-m // row_splits)
    nc = min(n, (-(-n // col_splits) + 15) // 16 * 16)
    return mc, nc


@functools.cache
def get() -> CpuPool | None:
    """The process's pool, started on first use with ``torch.get_num_threads()`` threads; None when it is switched
    off (``STRATA_CPU_POOL=0``), torch has one thread, or torch's MKL or a C compiler is missing."""
    threads = torch.get_num_threads()
    if not envs.STRATA_CPU_POOL or threads < 2:
        return None
    blas = cpu_kernel.torch_blas()
    if blas is None:
        log.warning("torch has no MKL sgemm here: the CPU engine keeps torch's threads")
        return None
    lib = cpu_kernel.load_pool()
    if lib is None:
        return None
    started = lib.strata_pool_start(threads, _SPIN_NS, _YIELD_NS, blas[1])
    pool = CpuPool(lib, started, blas[0])
    for other in (cpu_kernel.load(), cpu_kernel.load_layer_ops()):
        if other is not None:
            other.strata_set_pool(ctypes.c_void_p(pool.run_fn))
    return pool
