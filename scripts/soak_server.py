#!/usr/bin/env python3
"""Served soak on CPU: `strata serve` on a tiny random Llama with a KV pool too small for its load, streamed greedy
completions of long prompts (100-600 tokens, a shared prefix on half of them, so prefix caching and the CPU
kernel's prompt tiles run), a fifth of the clients hanging up after a few chunks. Checks, exit status 1 on any:
every request answered 200 with a clean stream (or hung up by its client); once idle, no running request and no
KV block in use (`/metrics`); every completed text equal to the offline `LLM` running that prompt alone.
Seeded, so a failure replays; the server's environment is this process's (e.g. STRATA_CPU_PACKED_WEIGHTS=1).

    python scripts/soak_server.py [--requests 400] [--concurrency 96] [--blocks 96] [--hang 0.2] [--seed 7]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import httpx  # noqa: E402
from _server import Server  # noqa: E402
from _tiny_checkpoint import write_random_llama  # noqa: E402


def workload(n: int, hang: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randint(10, 4000) for _ in range(300)]
    reqs = []
    for _ in range(n):
        plen, pre = rng.randint(100, 600), rng.choice([0, 0, 150, 300])
        reqs.append({"prompt": (shared[:pre] + [rng.randint(10, 4000) for _ in range(plen)])[:plen],
                     "max_tokens": rng.randint(16, 64), "hang_after": rng.randint(1, 10) if rng.random() < hang else 0})
    return reqs


async def one(client: httpx.AsyncClient, url: str, model: str, req: dict) -> tuple:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True}
    pieces, chunks = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            return ("http", resp.status_code, (await resp.aread())[:200])
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return ("ok", "".join(pieces))
            chunk = json.loads(payload)
            if "error" in chunk:
                return ("error", chunk["error"])
            pieces += [c.get("text", "") for c in chunk.get("choices", [])]
            chunks += 1
            if req["hang_after"] and chunks >= req["hang_after"]:
                return ("hung",)  # leaving the block closes the connection mid-stream
    return ("truncated",)


async def drive(url: str, model: str, reqs: list[dict], concurrency: int) -> tuple[list[tuple], dict[str, float]]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        async def guarded(req):
            async with sem:
                return await one(client, url, model, req)

        results = await asyncio.gather(*(guarded(r) for r in reqs))
        await asyncio.sleep(2)  # hung-up streams are aborted as their disconnects are noticed
        text = (await client.get(f"{url}/metrics")).text
    gauges = {}
    for line in text.splitlines():
        for name in ("strata:num_requests_running", "strata:kv_cache_usage_perc", "strata:num_preemptions_total"):
            if line.startswith(name + "{"):
                gauges[name] = float(line.rsplit(" ", 1)[1])
    return results, gauges


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=96)
    p.add_argument("--blocks", type=int, default=96, help="KV blocks of 16 tokens (96: ~2 long prompts at a time)")
    p.add_argument("--hang", type=float, default=0.2, help="fraction of clients that hang up mid-stream")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    reqs = workload(args.requests, args.hang, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_random_llama(Path(tmp) / "tiny-llama"))
        srv = Server([model, "--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", str(args.blocks),
                      "--block-size", "16", "--max-num-batched-tokens", "512", "--max-num-seqs", "128",
                      "--max-model-len", "1024"], Path(tmp) / "server.log")
        t0 = time.monotonic()
        try:
            results, gauges = asyncio.run(drive(srv.url, model, reqs, args.concurrency))
        finally:
            srv.stop()
        served_s = time.monotonic() - t0
        from strataserve import LLM, SamplingParams

        llm = LLM(model, dtype="float32", device="cpu")
        done = [i for i, r in enumerate(results) if r[0] == "ok"]
        mismatches = []
        for i in done:
            params = SamplingParams(temperature=0, max_tokens=reqs[i]["max_tokens"], ignore_eos=True)
            if llm.generate([reqs[i]["prompt"]], params, use_tqdm=False)[0].outputs[0].text != results[i][1]:
                mismatches.append(i)
    bad = [(i, r) for i, r in enumerate(results) if r[0] not in ("ok", "hung")]
    for i, r in bad[:5]:
        print(f"request {i}: {r}")
    if mismatches:
        print(f"completed texts unlike the solo run: requests {mismatches[:10]}")
    leaks = gauges.get("strata:num_requests_running") != 0 or gauges.get("strata:kv_cache_usage_perc") != 0
    print(f"requests={len(reqs)} completed={len(done)} hung_up={sum(r[0] == 'hung' for r in results)} bad={len(bad)} "
          f"mismatches={len(mismatches)} preemptions={gauges.get('strata:num_preemptions_total')} "
          f"running_after={gauges.get('strata:num_requests_running')} "
          f"kv_usage_after={gauges.get('strata:kv_cache_usage_perc')} served_s={served_s:.1f}")
    return 1 if bad or mismatches or leaks else 0


if __name__ == "__main__":
    sys.exit(main())
