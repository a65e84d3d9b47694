"""The decode-attention kernel's sm_90 machine code, compiled on a machine without a GPU: instruction counts of its
main loop per cache dtype. Triton's wheel ships ptxas and nvdisasm, so ``triton.compile`` with an explicit
``GPUTarget`` gives the SASS the H200 would run (the JIT's divisibility-by-16 hints are given by hand, as the JIT
would derive them from the real strides). Used in run 11 to rank variants before spending device time.

    python benchmarks/kernel_sass.py [--module FILE] [--block-n 64] [--warps 4] [--stages 2] [--block-h 16] [--top 12]

``--module``: another version of ``kernels/decode_attention.py`` (e.g. ``git show cb0e299:...``, run 10's, which
converted the 8-bit tile as loaded: 999 loop instructions for fp8).

One JSON line per cache dtype: the instructions of the largest backward-branch loop, the K/V bytes one iteration
reads, instructions per KB, registers, and the most frequent opcodes of the loop.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from _module_file import load_module
from strataserve.kernels import decode_attention

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {"q_ptr": "*bf16", "bt_ptr": "*i32", "ctx_ptr": "*i32", "po_ptr": "*fp32", "pl_ptr": "*fp32",
            "o_ptr": "*bf16", "sem_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
# integer arguments the JIT would mark divisible by 16 at the runner's shapes (strides of 128-wide heads)
DIVISIBLE = {"q_sb", "q_sh", "c_sb", "c_ss", "c_sh", "po_sb", "po_sh", "po_ss", "o_sb", "o_sh", "D", "slots", "few",
             "pl_sb"}


def compile_decode(module, cache: str, block_n: int, warps: int, stages: int, block_h: int = 16):
    """``cache``: bf16, fp8, int8 (8-bit caches as the kernel reads them: int32 words, or the 8-bit values for a
    kernel without the ``ASM`` parameter) or fp8dot (a kernel with a ``Q8`` switch: K read as fp8 bytes for an
    fp8 x fp8 q · K dot; run 14's experiment, ``benchmarks/results/kernel_sass_fp8dot/``). ``block_h``: the
    padded query-head rows per program (the kernel's 16; wgmma needs 64)."""
    fn = module._paged_decode_kernel
    quant = cache != "bf16"
    words = "ASM" in fn.arg_names
    const = dict(G=4, PAGE=16, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=128, IEEE=False, DIRECT=False,
                 REVERSE=True, QUANT=quant, INT=cache == "int8", ASM=quant, ADAPTIVE=True, BLOCK_B=64, BLOCK_S=16,
                 Q8=cache == "fp8dot")
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name == "kc_ptr" and cache == "fp8dot":
            sig[name] = "*fp8e4nv"
        elif name in ("kc_ptr", "vc_ptr"):
            sig[name] = "*bf16" if not quant else "*i32" if words else {"fp8": "*fp8e4nv", "int8": "*i8"}[cache[:4]]
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name in const:
            sig[name] = "constexpr"
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
        if name.endswith("_ptr") or name in DIVISIBLE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items() if k in fn.arg_names})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def _tool(name: str, args: list[str], cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, name), *args, f.name], capture_output=True, text=True,
                              check=True).stdout


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the largest loop: the longest span from a label back to a branch that jumps to it."""
    labels: dict[str, int] = {}
    insts: list[tuple[str, str]] = []
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(insts)
            continue
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", line)
        if m:
            insts.append((m.group(1), m.group(2)))
    best = (0, 0)
    for i, (op, rest) in enumerate(insts):
        target = re.search(r"(\.L_x_\d+)", rest) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), i) < i and i - labels[target.group(1)] > best[1] - best[0]:
            best = (labels[target.group(1)], i)
    return collections.Counter(op for op, _ in insts[best[0]:best[1] + 1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", help="another version of kernels/decode_attention.py")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--block-h", type=int, default=16, help="padded query-head rows per program")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    module = decode_attention
    if args.module:
        module = load_module(args.module, "other_decode")
    q8 = "Q8" in module._paged_decode_kernel.arg_names
    for cache in ("bf16", "fp8", "int8") + (("fp8dot",) if q8 else ()):
        k = compile_decode(module, cache, args.block_n, args.warps, args.stages, args.block_h)
        ops = loop_opcodes(_tool("nvdisasm", ["-c"], k.asm["cubin"]))
        regs = re.search(r"REG:(\d+)", _tool("cuobjdump", ["--dump-resource-usage"], k.asm["cubin"]))
        kv_bytes = 2 * args.block_n * 128 * (2 if cache == "bf16" else 1)
        n = sum(ops.values())
        print(json.dumps({"bench": "kernel_sass", "kernel": "paged_decode", "module": args.module or "this tree",
                          "cache": cache, "target": "sm_90",
                          "triton": triton.__version__, "block_n": args.block_n, "num_warps": args.warps,
                          "num_stages": args.stages, "block_h": args.block_h, "loop_instructions": n, "loop_kv_bytes": kv_bytes,
                          "warp_instructions_per_kb": round(n * args.warps * 1024 / kv_bytes, 1),
                          "registers": int(regs.group(1)) if regs else None,
                          "top_opcodes": ops.most_common(args.top)}), flush=True)


if __name__ == "__main__":
    main()
