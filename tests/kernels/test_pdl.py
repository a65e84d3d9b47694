"""Programmatic dependent launch (``kernels/_common.py``: ``pdl_args`` / ``pdl_start``).

The launches themselves run on the GPU (the GPU kernel tests launch every kernel with it on sm_90); here: when it is
on, and that a kernel compiled with it waits for the previous kernel before anything else (sm_90 PTX, compiled on
this machine without a GPU)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from strataserve import envs
from strataserve.kernels import _common

# every kernel of a decode step launched with programmatic dependent launch
PDL_KERNELS = [("strataserve.kernels.rms_norm", "_rms_norm_kernel"),
               ("strataserve.kernels.rms_norm", "_fused_add_rms_norm_kernel"),
               ("strataserve.kernels.activation", "_silu_and_mul_kernel"),
               ("strataserve.kernels.rotary_kv", "_rotary_store_kv_kernel"),
               ("strataserve.kernels.decode_attention", "_paged_decode_kernel"),
               ("strataserve.kernels.decode_attention", "_paged_decode_reduce_kernel"),
               ("strataserve.kernels.gemv", "_gemv_kernel"),
               ("strataserve.kernels.gemv", "_gemv_reduce_kernel")]


def test_off_on_cpu_under_the_interpreter_and_by_switch(monkeypatch):
    assert _common.pdl_args(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setattr(envs, "STRATA_PDL", False)
    assert _common.pdl_args(torch.zeros(1)) == {"PDL": False}


_PTX = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from strataserve.kernels.rms_norm import _fused_add_rms_norm_kernel as fn
out = {}
for pdl in (False, True):
    sig = {n: "*bf16" if n.endswith("_ptr") else "constexpr" if n in ("BLOCK", "PDL") else "fp32" if n == "eps"
           else "i32" for n in fn.arg_names}
    const = {(fn.arg_names.index("BLOCK"),): 1024, (fn.arg_names.index("PDL"),): pdl}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "launch_pdl": pdl})
    ops = []  # global loads and stores (often predicated: "@%p1 ld.global..."), and the grid dependency control
    for ln in k.asm["ptx"].splitlines():
        for op in ("ld.global", "st.global", "griddepcontrol.wait", "griddepcontrol.launch_dependents"):
            if op in ln:
                ops.append(op)
    out[str(pdl)] = ops
print(json.dumps(out))
"""


def test_a_pdl_kernel_waits_for_the_previous_one_before_it_reads_or_writes():
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled, not interpreted (this directory's conftest sets it)
    proc = subprocess.run([sys.executable, "-c", _PTX], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not any(op.startswith("griddepcontrol") for op in out["False"])
    on = out["True"]
    assert on[:2] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"], on[:4]
    assert "ld.global" in on and "st.global" in on


@pytest.mark.parametrize("module,kernel", PDL_KERNELS)
def test_decode_step_kernels_take_the_switch(module, kernel):
    import importlib
    fn = getattr(importlib.import_module(module), kernel)
    names = getattr(fn, "arg_names", None) or [p.name for p in fn.params]
    assert names[-1] == "PDL"
