"""GPU check of the served path: `strata serve --device cuda` (engine-core process, async scheduling on) must
return the same greedy text as the offline `LLM` class in eager mode, under concurrent and streaming requests.

Writes one JSON line to $OUT/gpu_serve_check.json and prints it.  Run on the GPU machine from the repo root:
    PYTHONPATH=.:tests python3 benchmarks/gpu_serve_check.py
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _tiny_models import make_tiny_checkpoint

N, MAX_NEW = 24, 24


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _query(url: str, prompts: list[list[int]], stream: bool) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(p):
            body = {"model": "tiny", "prompt": p, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                    "stream": stream}
            if not stream:
                r = await c.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                return r.json()["choices"][0]["text"]
            text = ""
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text
        return await asyncio.gather(*(one(p) for p in prompts))


def main() -> dict:
    from strataserve import LLM, SamplingParams

    tmp = tempfile.TemporaryDirectory()
    ckpt = make_tiny_checkpoint("llama3", Path(tmp.name) / "ckpt")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 512) for _ in range(rng.randint(3, 60))] for _ in range(N)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(model=str(ckpt), device="cuda", dtype="float32", mode="eager", gpu_memory_utilization=0.2)
    ref = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm.llm_engine.shutdown()  # one engine per GPU at a time: give its KV pool back before the server sizes its own
    del llm
    import gc, torch
    gc.collect()
    torch.cuda.empty_cache()
    port = _port()
    log = open(Path(tmp.name) / "server.log", "w")
    srv = subprocess.Popen([sys.executable, "-m", "strataserve", "serve", str(ckpt), "--device", "cuda", "--dtype",
                            "float32", "--port", str(port), "--host", "127.0.0.1", "--grpc-port", "0",
                            "--served-model-name", "tiny"], stdout=log, stderr=subprocess.STDOUT)
    res: dict = {"bench": "gpu_serve_check"}
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:
            if srv.poll() is not None or time.time() - t0 > 240:
                raise RuntimeError("server did not start: " + (Path(tmp.name) / "server.log").read_text()[-3000:])
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        res["startup_s"] = round(time.time() - t0, 1)
        plain = asyncio.run(_query(url, prompts, stream=False))
        streamed = asyncio.run(_query(url, prompts, stream=True))
        res.update(n=N, identical_plain=sum(a == b for a, b in zip(plain, ref)),
                   identical_stream=sum(a == b for a, b in zip(streamed, ref)))
        res["ok"] = res["identical_plain"] == N and res["identical_stream"] == N
    finally:
        srv.terminate()
        srv.wait(timeout=60)
        log.close()
        res["server_log_tail"] = (Path(tmp.name) / "server.log").read_text()[-800:]
    out = Path(os.environ.get("OUT", ".")) / "gpu_serve_check.json"
    out.write_text(json.dumps(res) + "\n")
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
