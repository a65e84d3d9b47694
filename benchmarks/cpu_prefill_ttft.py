"""Time to first token of one long prompt on the CPU engine (the prefill alone: ``max_tokens=1``).

A random checkpoint in Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 query / 8 KV heads of 128, vocabulary
151,936; float32, about 2.4 GB) is written once to ``--model`` if that folder has none. Each source tree in
``--tree`` runs in its own process (``PYTHONPATH=TREE``), in alternating order per round; each process warms up on
one prompt, then times one fresh random prompt per length. One line per (round, tree, length):

    round=1 tree=new prompt=2048 ttft_s=... prompt_tok_s=...

    python benchmarks/cpu_prefill_ttft.py --model /tmp/qwen3-0.6b-random --tree new=. --tree old=/path/to/tree
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192,
                 tie_word_embeddings=True)


def write_model(path: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(HERE))
    from _tiny_checkpoint import write_word_tokenizer

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B, bos_token_id=1, eos_token_id=2)).float().save_pretrained(path)
    write_word_tokenizer(path, QWEN3_06B["vocab_size"])


def child(model: str, lengths: list[int], batched: int) -> None:
    import random
    import time

    from strataserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", device="cpu", kv_cache_memory_gib=2, max_num_batched_tokens=batched,
              max_model_len=max(lengths) + 16)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = lambda n: {"prompt_token_ids": [rng.randrange(3, QWEN3_06B["vocab_size"]) for _ in range(n)]}  # noqa
    llm.generate([prompt(min(lengths))], params)  # warm-up: kernels built, buffers grown
    for n in lengths:
        t = time.perf_counter()
        llm.generate([prompt(n)], params)
        dt = time.perf_counter() - t
        print(f"prompt={n} ttft_s={dt:.3f} prompt_tok_s={n / dt:.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder (written here when it has no config.json)")
    p.add_argument("--tree", action="append", required=True, help="NAME=SOURCE_TREE (repeat)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.model, args.lengths, args.max_num_batched_tokens)
        return
    if not (Path(args.model) / "config.json").exists():
        write_model(Path(args.model))
    trees = [(name, os.path.abspath(tree)) for name, _, tree in (t.partition("=") for t in args.tree)]
    for r in range(1, args.rounds + 1):
        for name, tree in (trees if r % 2 else trees[::-1]):
            env = {**os.environ, "PYTHONPATH": tree}
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--tree", "x=.", "--lengths",
                   *map(str, args.lengths), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                if line.startswith("prompt="):
                    print(f"round={r} tree={name} {line}", flush=True)


if __name__ == "__main__":
    main()
