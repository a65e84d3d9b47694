"""Kernel arguments that change from step to step must not be specialised on by Triton (each new divisibility class
of such an argument compiles another variant of the kernel in the middle of serving: ~1 s on a cold cache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# (module, kernel, the arguments that vary per step on the eager path)
PER_STEP_ARGS = [("strataserve.kernels.decode_attention", "_paged_decode_kernel", ["bt_sb"]),
                 ("strataserve.kernels.prefill_attention", "_prefill_attention_kernel", ["bt_sb"])]


@pytest.mark.parametrize("module,kernel,args", PER_STEP_ARGS)
def test_per_step_arguments_are_not_specialised(module, kernel, args):
    # the compiled (not interpreted) JIT function carries the specialisation settings: import it without
    # TRITON_INTERPRET, which this directory's conftest sets for everything else
    code = (f"import json; from {module} import {kernel} as k; "
            "print(json.dumps({p.name: bool(p.do_not_specialize) for p in k.params}))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    flags = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(flags[a] for a in args), flags
    # the cache strides and head dims are fixed for an engine's life: those stay specialised (alignment helps)
    assert not flags["c_sb"] and not flags["D"]
