"""Where a structured-output step's host time goes: xgrammar's batch bitmask fill for R constrained rows at 1..N
threads, and the device side (the bitmask's copy and the logits mask) for the same rows.

Matchers for ``structured_throughput.SCHEMA`` are placed inside a JSON string at different lengths, then
``BatchGrammarMatcher.batch_fill_next_token_bitmask`` is timed (median of REPEAT) per thread count. Prints one ``FILL {...}`` line per (rows, threads) and ``APPLY {...}`` per rows.

    python benchmarks/grammar_fill_threads.py TOKENIZER_DIR [--vocab-size 151936] [--rows 64,256] [--threads 1,2,4,8]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from structured_throughput import SCHEMA  # noqa: E402


def advanced_matchers(xgr, tok, compiled, n: int, seed: int) -> list:
    """``n`` matchers inside the first object's "name" string, at different lengths: where a random-weight model
    spends nearly all its constrained tokens, and the dearest state to fill (~145k of 151k tokens allowed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        m = xgr.GrammarMatcher(compiled)
        text = '[{"name": "' + "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(1, 60)))
        for t in tok.encode(text, add_special_tokens=False):
            if not m.accept_token(t):
                raise RuntimeError(f"the grammar refused {text!r}")
        out.append(m)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tokenizer")
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--rows", default="64,256")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from strataserve.runner.logits_mask import apply_token_bitmask

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=args.vocab_size)
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=8).compile_json_schema(json.dumps(SCHEMA))
    print(f"# compile_s={time.perf_counter() - t0:.2f}", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        live = advanced_matchers(xgr, tok, compiled, rows, rows)
        bitmask = xgr.allocate_token_bitmask(len(live), args.vocab_size)
        for threads in (int(t) for t in args.threads.split(",")):
            batch = xgr.BatchGrammarMatcher(max_threads=threads)
            batch.batch_fill_next_token_bitmask(live, bitmask, list(range(len(live))))  # warm
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                batch.batch_fill_next_token_bitmask(live, bitmask, list(range(len(live))))
                times.append(time.perf_counter() - t0)
            print("FILL " + json.dumps(dict(rows=len(live), threads=threads,
                                            ms=round(statistics.median(times) * 1e3, 3))), flush=True)
        if torch.cuda.is_available():
            logits = torch.randn(len(live), args.vocab_size, device="cuda", dtype=torch.float32)
            apply_token_bitmask(logits, list(range(len(live))), bitmask)
            torch.cuda.synchronize()
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                apply_token_bitmask(logits, list(range(len(live))), bitmask)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            print("APPLY " + json.dumps(dict(rows=len(live), ms=round(statistics.median(times) * 1e3, 3))),
                  flush=True)


if __name__ == "__main__":
    main()
