"""Server vs offline engine throughput (issue 4's benchmark), same checkpoint, same workload, same run.

1. Offline: ``benchmarks/offline_throughput.py`` (LLM.generate, all requests at once).
2. Server: ``strata serve`` on the same checkpoint and engine settings, loaded by ``strata bench serve`` with the
   random dataset (lengths uniform in the same ranges), ``--max-concurrency 64``, ``--ignore-eos``.

Prints one line: ``offline_tok_per_s=... offline_capped_tok_per_s=... server_tok_per_s=... ratio=...
ratio_capped=...``; "capped" is the offline engine with ``max_num_seqs`` = the server run's concurrency, the
like-for-like figure for the cost of the process boundary and HTTP.

    python benchmarks/serve_throughput.py                     # tiny random Llama on CPU
    python benchmarks/serve_throughput.py --model DIR --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _server import Server  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: a tiny random Llama, hidden 256)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    p.add_argument("--skip-offline", action="store_true")
    args = p.parse_args(argv)

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from _tiny_checkpoint import write_random_llama

        model = str(write_random_llama(Path(tmp.name) / "tiny-llama"))
    common = ["--dtype", args.dtype, "--device", args.device, "--max-num-batched-tokens",
              str(args.max_num_batched_tokens), "--kv-cache-memory-gib", str(args.kv_cache_memory_gib)]
    offline = capped = None
    if not args.skip_offline:
        import offline_throughput

        workload = ["--model", model, "--num-requests", str(args.num_requests), "--input-len", str(args.min_len),
                    str(args.max_len), "--output-len", str(args.min_len), str(args.max_len), *common]
        offline = offline_throughput.main(workload)  # every request at once, as issue 2's benchmark
        # The same engine with its batch capped at the server run's concurrency: isolates the process/HTTP cost.
        capped = offline_throughput.main([*workload, "--max-num-seqs", str(args.max_concurrency)])

    server = Server([model, *common], Path(tmp.name) / "server.log")
    try:
        url = server.url
        mean = (args.min_len + args.max_len) / 2
        ratio = (args.max_len - args.min_len) / (args.max_len + args.min_len)
        out_file = Path(tmp.name) / "bench.json"
        bench = [sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", url, "--tokenizer", model,
                 "--dataset-name", "random", "--random-input-len", str(int(mean)), "--random-output-len",
                 str(int(mean)), "--random-range-ratio", f"{ratio:.4f}", "--num-prompts", str(args.num_requests),
                 "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--num-warmups", "16",
                 "--disable-tqdm", "--save-result", str(out_file)]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out_file.read_text())
    finally:
        server.stop()
    served = result["output_throughput"]
    res = {"offline_tok_per_s": offline["tok_per_s"] if offline else None,
           "offline_capped_tok_per_s": capped["tok_per_s"] if capped else None,
           "server_tok_per_s": round(served, 1),
           "ratio": round(served / offline["tok_per_s"], 3) if offline else None,
           "ratio_capped": round(served / capped["tok_per_s"], 3) if capped else None,
           "requests": args.num_requests, "max_concurrency": args.max_concurrency, "device": args.device,
           "failed": result["failed"], "mean_ttft_ms": round(result["mean_ttft_ms"], 1),
           "mean_tpot_ms": round(result["mean_tpot_ms"], 2)}
    print(" ".join(f"{k}={v}" for k, v in res.items()), flush=True)
    tmp.cleanup()
    return res


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
