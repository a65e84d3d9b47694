"""Issue 9's benchmark: what the router costs, and what SLA classes buy. Two parts, same run, CPU by default.

1. Overhead: an upstream ``strata serve`` (tiny random Llama) loaded by ``strata bench serve`` at concurrency 64
   (random prompts and outputs, lengths uniform in [32, 256], ignore_eos), directly and through a router
   (``strata serve --config`` with the upstream as an ``upstream: openai`` model). Rounds alternate which side
   runs first. Goal: router output tok/s >= 0.95 x direct, in every round.
2. SLA: a router serving a local copy of the model with classes ``interactive`` (priority 0) and ``batch``
   (priority 10). Interactive TTFT (streamed, 16 output tokens, sequential probes) on an idle server, then
   under a closed-loop flood of ``batch`` requests that keeps every engine slot busy and a queue waiting; as a
   control, the same probes sent as ``batch`` under the same flood. Goal: interactive P50 TTFT under the flood
   <= 2x its idle P50, in every round.

Prints one line per round and a final summary line:
``overhead_ratio_min=... overhead_ratios=... sla_ratio_max=... sla_ratios=...``.

    python benchmarks/router_bench.py                 # 3 rounds, CPU
    python benchmarks/router_bench.py --rounds 1 --num-prompts 128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _server import Server  # noqa: E402


def bench_serve(url: str, model: str, tokenizer: str, args: argparse.Namespace, out: Path) -> dict:
    mean = (args.min_len + args.max_len) / 2
    ratio = (args.max_len - args.min_len) / (args.max_len + args.min_len)
    cmd = [sys.executable, "-m", "strataserve", "bench", "serve", "--base-url", url, "--model", model,
           "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(int(mean)),
           "--random-output-len", str(int(mean)), "--random-range-ratio", f"{ratio:.4f}", "--num-prompts",
           str(args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--ignore-eos",
           "--num-warmups", "16", "--disable-tqdm", "--seed", "0", "--save-result", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


async def _ttft(session: aiohttp.ClientSession, url: str, sla: str, max_tokens: int) -> float:
    body = {"model": "chat", "prompt": "The history of the old town", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body, headers={"x-sla-class": sla}) as r:
        r.raise_for_status()
        async for line in r.content:
            if first is None and line.startswith(b"data:") and b'"text"' in line:
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def _probe(url: str, sla: str, n: int) -> list[float]:
    async with aiohttp.ClientSession() as s:
        out = []
        for _ in range(n):
            out.append(await _ttft(s, url, sla, 16))
            await asyncio.sleep(0.05)
        return out


async def _under_flood(url: str, sla: str, n: int, flood: int, flood_tokens: int) -> list[float]:
    stop = asyncio.Event()

    async def worker(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            await _ttft(s, url, "batch", flood_tokens)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = [asyncio.ensure_future(worker(s)) for _ in range(flood)]
        await asyncio.sleep(3.0)  # the flood fills the slots and builds a queue
        try:
            return await _probe(url, sla, n)
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--probes", type=int, default=15)
    p.add_argument("--flood", type=int, default=48, help="concurrent batch requests in the SLA flood")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-sla", action="store_true")
    args = p.parse_args(argv)

    from _tiny_checkpoint import write_random_llama

    tmp = Path(tempfile.mkdtemp())
    model = str(write_random_llama(tmp / "tiny-llama"))
    engine = ["--device", "cpu", "--dtype", "float32", "--max-num-batched-tokens", "2048",
              "--kv-cache-memory-gib", "2.0"]
    res: dict = {}
    if not args.skip_overhead:
        upstream = Server([model, "--served-model-name", "tiny", "--grpc-port", "0", *engine], tmp / "upstream.log")
        cfg = tmp / "router.yaml"
        cfg.write_text(yaml.safe_dump({"models": [{"name": "tiny", "upstream": "openai", "url": upstream.url}]}))
        router = Server(["--config", str(cfg), "--grpc-port", "0"], tmp / "router.log")
        ratios = []
        try:
            for rnd in range(args.rounds):
                order = ("direct", "router") if rnd % 2 == 0 else ("router", "direct")
                got = {}
                for side in order:
                    url = upstream.url if side == "direct" else router.url
                    got[side] = bench_serve(url, "tiny", model, args, tmp / f"{side}{rnd}.json")
                d, r = got["direct"]["output_throughput"], got["router"]["output_throughput"]
                ratios.append(r / d)
                print(f"overhead round={rnd} first={order[0]} direct_tok_per_s={d:.1f} router_tok_per_s={r:.1f} "
                      f"ratio={r / d:.3f} failed={got['direct']['failed']}+{got['router']['failed']}", flush=True)
        finally:
            router.stop()
            upstream.stop()
        res.update(overhead_ratio_min=round(min(ratios), 3), overhead_ratios=",".join(f"{x:.3f}" for x in ratios))
    if not args.skip_sla:
        cfg = tmp / "sla.yaml"
        cfg.write_text(yaml.safe_dump({
            "models": [{"name": "chat", "path": model, "device": "cpu", "dtype": "float32", "max_num_seqs": 16,
                        "max_num_batched_tokens": 512, "kv_cache_memory_gib": 1.0}],
            "sla_classes": {"interactive": {"priority": 0}, "batch": {"priority": 10}}}))
        router = Server(["--config", str(cfg), "--grpc-port", "0"], tmp / "sla.log")
        sla_ratios = []
        try:
            asyncio.run(_probe(router.url, "interactive", 5))  # warm-up
            for rnd in range(args.rounds):
                idle_first = rnd % 2 == 0
                if idle_first:
                    idle = asyncio.run(_probe(router.url, "interactive", args.probes))
                loaded = asyncio.run(_under_flood(router.url, "interactive", args.probes, args.flood, 256))
                control = asyncio.run(_under_flood(router.url, "batch", max(5, args.probes // 3), args.flood, 256))
                if not idle_first:
                    time.sleep(2.0)  # the aborted flood drains
                    idle = asyncio.run(_probe(router.url, "interactive", args.probes))
                i50, l50, c50 = (statistics.median(x) * 1000 for x in (idle, loaded, control))
                sla_ratios.append(l50 / i50)
                print(f"sla round={rnd} idle_first={idle_first} interactive_idle_p50_ms={i50:.1f} "
                      f"interactive_flood_p50_ms={l50:.1f} ratio={l50 / i50:.2f} "
                      f"same_probe_as_batch_p50_ms={c50:.1f}", flush=True)
        finally:
            router.stop()
        res.update(sla_ratio_max=round(max(sla_ratios), 3), sla_ratios=",".join(f"{x:.2f}" for x in sla_ratios))
    print(" ".join(f"{k}={v}" for k, v in res.items()), flush=True)
    return res


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
