"""`strata serve` start-up: process start -> /health 200, for code trees compared in alternating order, plus the
breakdown each server prints (engine phases, API imports, HTTP ready).

    python benchmarks/serve_startup.py --model CKPT --tree before=/path/a --tree after=/path/b [--rounds 3]
        [--env NAME:VAR=VALUE ...] [--write-8b CKPT] [-- extra serve args]

Each tree's code runs with ``PYTHONPATH=<tree>`` (plus the caller's PYTHONPATH, e.g. carried wheels). Round r
runs the trees in order when r is odd, reversed when even. ``--env NAME:VAR=VALUE`` sets VAR for tree NAME's
servers (one tree path under two names compares a switch). ``--write-8b`` first writes a random Llama-3.1-8B-shaped
bf16 checkpoint (4 shards + index, word-level tokenizer) on the GPU machine. One JSON line per start to stdout and
$OUT/serve_startup.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import Server  # noqa: E402
from _tiny_checkpoint import write_word_tokenizer  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
LOGS = Path(os.environ.get("LOGS", OUT))  # each server's log


def write_8b_config(path: Path) -> Path:
    """config.json of Llama-3.1-8B and a word-level tokenizer of its vocabulary size: all that
    ``--load-format dummy`` reads."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({  # the 4.x layout, which hf_config.py reads
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}))
    write_word_tokenizer(path, 128256)
    return path


def write_random_8b(path: Path, shards: int = 4) -> Path:
    """Llama-3.1-8B shapes, N(0, 0.02) bf16 weights made on the GPU, HF tensor names, sharded with an index."""
    import torch
    from safetensors.torch import save_file

    write_8b_config(path)
    h, i, kv = 4096, 14336, 8 * 128
    per_layer = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
                 "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
                 "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (128256, h))]
    names += [(f"model.layers.{n}.{k}", s) for n in range(32) for k, s in per_layer.items()]
    names += [("model.norm.weight", (h,)), ("lm_head.weight", (128256, h))]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight_map, per_shard = {}, -(-len(names) // shards)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for name, shape in names[s * per_shard:(s + 1) * per_shard]:
            t = torch.ones(shape, dtype=torch.bfloat16, device="cuda") if len(shape) == 1 else \
                (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
            part[name] = t.cpu()
            weight_map[name] = file
        save_file(part, str(path / file), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


_PATTERNS = {"imports_s": r"API process imports (\d+\.\d+) s", "engine_spawned_s": r"spawned at (\d+\.\d+) s",
             "engine_ready_s": r"ready at (\d+\.\d+) s", "http_ready_s": r"HTTP ready (\d+\.\d+) s",
             "tokenizer_s": r"tokenizer (\d+\.\d+) s", "kv_blocks": r"KV cache: (\d+) blocks"}


def parse_log(text: str) -> dict:
    out: dict = {k: float(m[1]) for k, p in _PATTERNS.items() if (m := re.search(p, text))}
    m = re.search(r"engine process: spawned at .*? \((.*?)\); tokenizer", text, re.S)
    if m:
        out["engine_phases"] = {a: float(b) for a, b in re.findall(r"([A-Za-z][\w ]*?) (\d+\.\d+) s", m[1])}
    return out


def start_once(tree: Path, model: str, extra: list[str], log: Path, timeout_s: float = 300,
               env_extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", **(env_extra or {}))
    t0 = time.perf_counter()
    srv = Server([model, "--grpc-port", "0", *extra], log, timeout_s, env=env, cwd=tree, poll_s=0.05)
    ready = time.perf_counter() - t0
    time.sleep(0.3)  # the ready line is printed right after uvicorn reports started
    srv.stop()
    return {"ready_s": round(ready, 2), **parse_log(log.read_text(errors="replace"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a code tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write-8b", action="store_true", help="write the random 8B checkpoint at --model first")
    ap.add_argument("--env", action="append", default=[], help="NAME:VAR=VALUE for tree NAME's servers")
    ap.add_argument("extra", nargs="*", help="extra `strata serve` arguments (after --)")
    args = ap.parse_args()
    envs: dict[str, dict] = {}
    for spec in args.env:
        name, _, assign = spec.partition(":")
        var, _, value = assign.partition("=")
        envs.setdefault(name, {})[var] = value
    if args.write_8b and not (Path(args.model) / "config.json").exists():
        t0 = time.perf_counter()
        write_random_8b(Path(args.model))
        print(json.dumps({"bench": "write_8b_checkpoint", "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    trees = [(name, Path(p).resolve()) for name, p in (t.split("=", 1) for t in args.tree)]
    for r in range(1, args.rounds + 1):
        for name, tree in (trees if r % 2 else trees[::-1]):
            row = {"bench": "serve_startup", "tree": name, "round": r, "model": Path(args.model).name,
                   "args": args.extra, "env": envs.get(name, {})}
            try:
                row.update(start_once(tree, args.model, args.extra, LOGS / f"serve_{name}_{r}.log",
                                      env_extra=envs.get(name)))
            except Exception as exc:  # one failed start must not lose the others
                row["error"] = repr(exc)[:600]
            line = json.dumps(row)
            print(line, flush=True)
            with (OUT / "serve_startup.jsonl").open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
