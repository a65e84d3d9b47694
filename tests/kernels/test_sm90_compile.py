"""Kernels compiled for the H200's sm_90 on this machine (the wheel ships ptxas): the interpreter that runs the
other kernel tests executes Python, so it accepts what the compiler refuses (e.g. a non-constexpr global read
inside a kernel, which broke run 16's first device call). Compiled in a subprocess: the interpreter, once on,
patches ``triton.language`` for the whole process."""
from __future__ import annotations

import os
import subprocess
import sys

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from strataserve.kernels import gemv

fn = gemv._gemv_kernel
for prologue, split in ((gemv.NO_PROLOGUE, 2), (gemv.NORM, 1), (gemv.ADD_NORM, 1), (gemv.ADD_NORM, 2),
                       (gemv.SILU_MUL, 2)):
    const = dict(HAS_BIAS=True, SPLIT=split, PROLOGUE=prologue, BLOCK_N=16, BLOCK_K=512,
                 EVICT="evict_first" if prologue == gemv.ADD_NORM else "", STAGES=1 + 2 * (prologue % 2),
                 NORM_IN_LOOP=prologue in (gemv.NORM, gemv.ADD_NORM) and split == 1)
    sig = {n: "*bf16" if n.endswith("_ptr") else "constexpr" if n in const else "fp32" if n == "eps" else "i32"
           for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    assert kernel.asm["cubin"], prologue
    print("compiled", prologue, split)

from strataserve.kernels import argmax
for fn, sig, const in (
        (argmax._chunk_argmax_kernel, {"x_ptr": "*bf16", "pv_ptr": "*fp32", "pi_ptr": "*i32"}, {"BLOCK": 4096}),
        (argmax._row_argmax_kernel, {"pv_ptr": "*fp32", "pi_ptr": "*i32", "out_ptr": "*i64"}, {"BLOCK_C": 32})):
    sig = {n: sig.get(n, "constexpr" if n in const else "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]
    print("compiled", fn.__name__)
"""


def test_gemv_and_argmax_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ("compiled 0 2 compiled 1 1 compiled 2 1 compiled 2 2 compiled 3 2 "
                                   "compiled _chunk_argmax_kernel compiled _row_argmax_kernel").split()
