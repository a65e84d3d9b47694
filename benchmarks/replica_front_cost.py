"""What the serving process spends per output token on the replicas' outputs, without any model: the ceiling on
total tok/s that one front process can take from all of a model's replicas (issue 15's ">= 1.9x with 2").

Every replica is an ``AsyncLLM`` front (output pump, msgpack decode, incremental detokenisation, per-request
streams) behind the router's ``ReplicatedEngine``; its core is replaced by an instant one that emits one token
for every live request per step, encoded and decoded through msgpack like the zmq wire. 256 requests of 300
tokens each, all at once (the shape of the nano-vllm workload's decode phase). Reported: process CPU
microseconds per output token and the tok/s ceiling that gives (1e6 / us). Rounds alternate 1 and 2 replicas.

    python benchmarks/replica_front_cost.py [--rounds 3] [--vocab 151936]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import msgspec  # noqa: E402

from strataserve.engine.core_client import CoreClient, CoreInfo  # noqa: E402
from strataserve.types.protocol import EngineCoreOutput, EngineCoreOutputs  # noqa: E402


class InstantCore(CoreClient):
    """One token for every live request per ``get_outputs`` call, through a msgpack round trip."""

    def __init__(self) -> None:
        super().__init__()
        self.info = CoreInfo(max_model_len=4096, num_blocks=100_000, block_size=16)
        self.left: dict[str, int] = {}
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)

    def add_request(self, request) -> None:
        self.left[request.request_id] = request.sampling_params.max_tokens

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.left.pop(rid, None)

    async def get_outputs(self) -> EngineCoreOutputs:
        await asyncio.sleep(0)  # one step: let the consumers run
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            outs.append(EngineCoreOutput(request_id=rid, new_token_ids=[3 + len(outs)],
                                         finish_reason="length" if done else None))
        return self.dec.decode(self.enc.encode(EngineCoreOutputs(outputs=outs)))

    def shutdown(self) -> None:
        self.left.clear()


def measure(path: Path, k: int, n: int, out_len: int) -> dict:
    from strataserve.config import EngineConfig, ModelConfig
    from strataserve.engine.async_llm import AsyncLLM
    from strataserve.engine.input_processor import load_tokenizer
    from strataserve.types.sampling import SamplingParams
    from strataserve.router.local_replicas import ReplicatedEngine

    cfg = EngineConfig(model=ModelConfig(model=str(path), device="cpu"))
    tok = load_tokenizer(str(path))
    engine = ReplicatedEngine("m", [AsyncLLM(cfg, core_client=InstantCore(), tokenizer=tok) for _ in range(k)])

    async def one(i: int) -> int:
        # the server's kind: deltas
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind="delta")
        got = 0
        async for out in engine.generate([5] * 200, params, f"r{i}"):
            got += sum(len(c.token_ids) for c in out.outputs)
        return got

    async def all_of_them() -> int:
        return sum(await asyncio.gather(*(one(i) for i in range(n))))

    t0, c0 = time.perf_counter(), time.process_time()
    tokens = asyncio.run(all_of_them())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    engine.shutdown()
    assert tokens == n * out_len, tokens
    us = cpu / tokens * 1e6
    return {"replicas": k, "tokens": tokens, "wall_s": round(wall, 2), "cpu_us_per_token": round(us, 1),
            "ceiling_tok_s": round(1e6 / us)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=151936, help="word-level tokenizer size (Qwen3's by default)")
    args = ap.parse_args()
    from _tiny_checkpoint import write_random_llama

    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_llama(Path(tmp) / "m", vocab_size=args.vocab, num_hidden_layers=1, hidden_size=64,
                                  intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
        rows = []
        for rnd in range(args.rounds):
            for k in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                row = {"round": rnd, **measure(path, k, args.num_requests, args.output_len)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    us = {k: [r["cpu_us_per_token"] for r in rows if r["replicas"] == k] for k in (1, 2)}
    print(f"replica_front_cost us_per_token_1={us[1]} us_per_token_2={us[2]} "
          f"ceiling_tok_s_min={min(r['ceiling_tok_s'] for r in rows)}")


if __name__ == "__main__":
    main()
