"""Build, load and call the CPU C kernels: paged attention (``cpu_paged_attention.c``), a decoder layer's
elementwise groups (``cpu_layer_ops.c``) and the engine's thread pool (``cpu_pool.c``); each file's header says
what it computes. The kernels' parallel loops run on the pool once ``cpu_pool.get()`` has started it, else on
OpenMP (``cpu_par.h``).

Each C file is compiled once per machine with the system C compiler (``$CC``, else ``cc``) into
``STRATA_KERNEL_CACHE`` (default ``~/.cache/strataserve/kernels``), named by a hash of the source, the flags, the
compiler and the CPU, and loaded with ctypes (whose calls release the GIL). Plain C with no torch headers: it
compiles in about two seconds. Without a compiler ``load()`` returns None and says why; the caller falls back to
the PyTorch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from strataserve import envs

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# -march=native: the library is built on the machine that runs it (the cache key holds the CPU's flags).
# No -ffast-math: linking it would switch the whole process to flush-to-zero. -fno-trapping-math changes no result
# (nothing here unmasks FP traps), but without it gcc will not vectorise floorf, so exp stays scalar.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-std=gnu11", "-shared", "-fPIC"]
# The layer ops round as PyTorch does: no multiply-adds fused behind the source's back.
_EXTRA_FLAGS = {"cpu_layer_ops": ["-ffp-contract=off"]}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i32p = ctypes.POINTER(ctypes.c_int32)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                return line
    except OSError:
        pass
    return ""


def _build(cc: str, source: Path, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # same filesystem: the rename is atomic
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *flags, "-o", str(out), str(source)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(out, target)


def _library(name: str) -> ctypes.CDLL | None:
    """``name``.c compiled here (on first use) and loaded, or None when it cannot be built."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        log.warning("no C compiler (%s) found: the CPU runs PyTorch ops instead of %s.c (slower)", cc, name)
        return None
    source, flags = _HERE / f"{name}.c", [*_FLAGS, *_EXTRA_FLAGS.get(name, [])]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        headers = [h.read_text() for h in sorted(_HERE.glob("cpu_*.h"))]  # what the sources include
        key = hashlib.sha256("\0".join([source.read_text(), *headers, *flags, version, _cpu_flags()]).encode())
        target = Path(envs.STRATA_KERNEL_CACHE) / f"{name}-{key.hexdigest()[:16]}.so"
        if not target.exists():
            _build(cc, source, flags, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernel %s unavailable (%s): falling back to PyTorch ops", name, exc)
        return None


_p, _int32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
# Each library's exported functions: name -> (return type, argument types).
_SIGNATURES: dict[str, dict[str, tuple[type | None, list]]] = {
    "cpu_paged_attention": {
        "strata_paged_attention": (ctypes.c_int, [_p, _i64, _p, _p, _p, _i32p, _i64, _i32p, _i32p, _i32p, _int32,
                                                  _int32, _int32, _int32, _int32, _f32, _int32, _int32]),
        "strata_set_pool": (None, [_p]),
        "strata_set_blas": (None, [_p, _p]),
    },
    "cpu_layer_ops": {
        "strata_add_rms_norm": (None, [_p, _i64, _p, _p, _p, _i64, _i64, _f32]),
        "strata_rotary_store": (None, [_p, _i64, _i64, _int32, _int32, _int32, _p, _p, _p, _p, _f32, _p, _p, _p]),
        "strata_silu_mul": (None, [_p, _i64, _p, _i64, _i64]),
        "strata_row_argmax": (None, [_p, _i64, _p, _i64, _i64]),
        "strata_set_pool": (None, [_p]),
    },
    "cpu_pool": {
        "strata_pool_start": (ctypes.c_int, [ctypes.c_int, _i64, _i64, _p]),
        "strata_pool_run": (None, [_p, _p, _i64]),
        "strata_linear": (None, [_p, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i64]),
        "strata_linear_packed": (None, [_p, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i64]),
    },
}


def _typed(name: str) -> ctypes.CDLL | None:
    """``_library(name)`` with its functions' signatures set."""
    lib = _library(name)
    if lib is not None:
        for fn, (res, args) in _SIGNATURES[name].items():
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
    return lib


@functools.cache
def _libtorch_cpu() -> ctypes.CDLL | None:
    """torch's own libtorch_cpu (where its MKL is linked in), or None."""
    try:
        return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return None


@functools.cache
def torch_blas() -> tuple[int, int] | None:
    """Addresses of torch's own ``sgemm_`` and ``mkl_set_num_threads_local`` (None: torch has no MKL here)."""
    tl = _libtorch_cpu()
    try:
        sgemm = ctypes.cast(tl.sgemm_, ctypes.c_void_p).value  # type: ignore[union-attr]
    except AttributeError:
        return None
    try:
        local = ctypes.cast(tl.mkl_set_num_threads_local, ctypes.c_void_p).value
    except AttributeError:
        return None  # a BLAS without per-thread control would thread each tile by itself
    return (sgemm, local) if sgemm else None


class MklPacking:
    """MKL's packed GEMM from torch's own copy: ``pack(w)`` packs a contiguous float32 ``[n, k]`` weight as the
    transposed B operand once; ``compute`` is ``cblas_sgemm_compute``'s address for ``cpu_pool.c``."""

    ROW_MAJOR, TRANS, B_MATRIX = 101, 112, 162
    PACK_ROWS = 64  # the row count given to the packing (the packed B serves any row count)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._size = lib.cblas_sgemm_pack_get_size
        self._size.restype, self._size.argtypes = ctypes.c_size_t, [ctypes.c_int] * 4
        self._pack = lib.cblas_sgemm_pack
        self._pack.restype = None
        self._pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, _p, ctypes.c_int, _p]
        self.compute: int = ctypes.cast(lib.cblas_sgemm_compute, ctypes.c_void_p).value  # type: ignore[assignment]

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        out = torch.empty(-(-self._size(self.B_MATRIX, self.PACK_ROWS, n, k) // 4), dtype=torch.float32)
        self._pack(self.ROW_MAJOR, self.B_MATRIX, self.TRANS, self.PACK_ROWS, n, k, 1.0, w.data_ptr(), k,
                   out.data_ptr())
        return out


@functools.cache
def mkl_packing() -> MklPacking | None:
    """torch's MKL packed GEMM, or None where torch has no MKL (or one without it)."""
    if torch_blas() is None:
        return None
    try:
        return MklPacking(_libtorch_cpu())  # type: ignore[arg-type]
    except AttributeError:
        return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled paged-attention library (built on first use), or None when it cannot be built here. With
    torch's MKL it gets its ``sgemm_``, for long float32 prompt chunks (``cpu_attention_gemm.h``)."""
    lib = _typed("cpu_paged_attention")
    blas = torch_blas()
    if lib is not None and blas is not None:
        lib.strata_set_blas(ctypes.c_void_p(blas[0]), ctypes.c_void_p(blas[1]))
    return lib


@functools.cache
def load_layer_ops() -> ctypes.CDLL | None:
    """The compiled layer-ops library (``cpu_layer_ops.c``), or None when it cannot be built here."""
    return _typed("cpu_layer_ops")


@functools.cache
def load_pool() -> ctypes.CDLL | None:
    """The compiled work-sharing pool (``cpu_pool.c``; ``runner/cpu_pool.py`` starts and drives it), or None."""
    return _typed("cpu_pool")


def _i32(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), _i32p)


def paged_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, kv_lens: torch.Tensor,
                    scale: float, window: int | None = None) -> None:
    """Attention of S sequences' query rows of ``q`` ``[T, Hq, D]`` into the same rows of ``out`` (contiguous
    ``[T, Hq, D]``), reading caches ``[num_blocks, block_size, Hkv, D]`` through ``block_tables`` (int32
    ``[S, max_blocks]``). Sequence s owns rows ``q_start[s] .. q_start[s] + q_len[s] - 1`` and ``kv_lens[s]``
    keys including them (int32 ``[S]`` each); its queries are its last positions, causal, and with a ``window``
    each sees only the last ``window`` positions up to itself."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU attention kernel could not be built (see the log)")
    t, hq, d = q.shape
    _, bs, hkv, d_cache = k_cache.shape
    dtype = _DTYPES.get(q.dtype)
    if dtype is None or not (q.dtype == out.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"CPU paged attention takes float32/bfloat16/float16 tensors of one dtype, got q {q.dtype}, "
                         f"out {out.dtype}, caches {k_cache.dtype}/{v_cache.dtype}")
    if d != d_cache or v_cache.shape != k_cache.shape or out.shape != q.shape or hq % hkv:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, out {tuple(out.shape)}, caches "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)}")
    if q.stride(2) != 1 or q.stride(1) != d or not (out.is_contiguous() and k_cache.is_contiguous()
                                                       and v_cache.is_contiguous()):
        raise ValueError("q needs contiguous heads (any row stride); out and the caches must be contiguous")
    s = kv_lens.shape[0]
    for name, x, shape in (("block_tables", block_tables, (s, block_tables.shape[-1])), ("q_start", q_start, (s,)),
                           ("q_len", q_len, (s,)), ("kv_lens", kv_lens, (s,))):
        if x.dtype != torch.int32 or tuple(x.shape) != shape or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 {shape}, got {x.dtype} {tuple(x.shape)}")
    if s == 0:
        return
    rc = lib.strata_paged_attention(q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(),
                                    v_cache.data_ptr(), _i32(block_tables), block_tables.stride(0), _i32(q_start),
                                    _i32(q_len), _i32(kv_lens), s, hq, hkv, d, bs, scale, window or 0, dtype)
    if rc != 0:
        raise RuntimeError(f"CPU paged attention failed with code {rc}")
