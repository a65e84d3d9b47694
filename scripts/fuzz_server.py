#!/usr/bin/env python3
"""Mutation fuzz of a running `strata serve`: valid requests with a few fields replaced by hostile values. Counts
the answers; any 5xx (HTTP) or INTERNAL / UNKNOWN (gRPC) is printed with its request and makes the exit status 1.
Seeded, so a failure replays.

    python scripts/fuzz_server.py openai URL --models NAME[,NAME] [-n 1500] [--seed 0]
    python scripts/fuzz_server.py kserve URL --models NAME[,NAME]     # JSON and binary-extension infer
    python scripts/fuzz_server.py grpc HOST:PORT --models NAME[,NAME]
    python scripts/fuzz_server.py speech URL --models NAME [--voice ryan --language english] [--nar]  # --nar: OmniVoice

KServe / gRPC models take a one-row FP32 input named by ``NAME:INPUT:WIDTH`` (e.g. ``onnx_mlp:INPUT0:4``) or a
BYTES input by ``NAME:INPUT:bytes``. The session of 2026-12-01 ran each against servers with the demo model, the
tests' standard model repository, a tiny Qwen3-TTS and a router in front (docs/performance.md is not involved:
this is about answers, not speed); what it found is fixed and pinned by tests (tests/kserve/test_kserve_fuzz.py
runs a bounded KServe fuzz in CI).
"""
from __future__ import annotations

import argparse
import base64
import collections
import copy
import json
import random
import struct
import sys
from typing import Any, Callable

HOSTILE: list[Any] = [None, True, False, 0, -1, 1, 2 ** 31, 2 ** 63, -(2 ** 63), 1e308, -1e308, 0.5, "", "x", "\x00",
                      "é" * 3, "a" * 5000, [], [None], [1, "a"], [[1]], {}, {"a": 1}, [-1, 2 ** 40], list(range(70)),
                      "FP32", "BYTES", "TYPE_FP32", [0], [1, 4], [-1, 4], [2 ** 31, 4], {"type": "json_object"},
                      {"type": "regex", "regex": "("}, [{"type": "function"}], "auto", "required"]


class Tally:
    def __init__(self) -> None:
        self.codes: collections.Counter = collections.Counter()
        self.bad = 0

    def record(self, what: str, code: Any, failed: bool, detail: str) -> None:
        self.codes[(what, code)] += 1
        if failed:
            self.bad += 1
            print(f"FAIL {what} {code}: {detail[:600]}", flush=True)

    def report(self) -> int:
        for (what, code), n in sorted(self.codes.items(), key=str):
            print(f"{what} {code}: {n}")
        print(f"failures: {self.bad}")
        return 1 if self.bad else 0


def mutate(rnd: random.Random, body: dict, max_edits: int = 3) -> dict:
    """Replace 1..max_edits values anywhere in ``body`` (or add/remove a key) with hostile ones."""
    body = copy.deepcopy(body)
    for _ in range(rnd.randint(1, max_edits)):
        target = body
        while isinstance(target, (dict, list)) and target and rnd.random() < 0.6:
            key = rnd.choice(list(target)) if isinstance(target, dict) else rnd.randrange(len(target))
            if not isinstance(target[key], (dict, list)):
                break
            target = target[key]
        value = copy.deepcopy(rnd.choice(HOSTILE))
        if isinstance(target, dict):
            key = rnd.choice(list(target) + [f"extra_{rnd.randint(0, 3)}"])
            if key in target and rnd.random() < 0.15:
                del target[key]
            else:
                target[key] = value
        elif isinstance(target, list) and target:
            target[rnd.randrange(len(target))] = value
    return body


def _models(spec: str) -> list[tuple[str, str, int | None]]:
    out = []
    for item in spec.split(","):
        name, _, rest = item.partition(":")
        inp, _, width = rest.partition(":")
        out.append((name, inp or "INPUT0", None if width == "bytes" else int(width or 4)))
    return out


def _tensor_body(inp: str, width: int | None) -> dict:
    if width is None:
        return {"inputs": [{"name": inp, "shape": [1], "datatype": "BYTES", "data": ["hello"]}]}
    return {"inputs": [{"name": inp, "shape": [1, width], "datatype": "FP32", "data": [0.5] * width}]}


def fuzz_openai(args: argparse.Namespace, rnd: random.Random, tally: Tally) -> None:
    import httpx
    models = args.models.split(",")
    completion = lambda: {"model": rnd.choice(models), "prompt": "Once upon", "max_tokens": 5, "logprobs": 2,  # noqa: E731
                          "stop": ["."], "temperature": 0.7, "seed": 1, "stream": rnd.random() < 0.4,
                          "logit_bias": {"5": 1.0}}
    chat = lambda: {"model": rnd.choice(models), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,  # noqa: E731
                    "logprobs": True, "top_logprobs": 2, "stream": rnd.random() < 0.4,
                    "response_format": {"type": "text"}}
    cases: list[tuple[str, Callable[[], dict]]] = [("/v1/completions", completion), ("/v1/chat/completions", chat),
                                                   ("/tokenize", lambda: {"prompt": "hello"}),
                                                   ("/detokenize", lambda: {"tokens": [1, 2, 3]})]
    with httpx.Client(base_url=args.url, timeout=120) as client:
        for _ in range(args.n):
            path, make = rnd.choice(cases)
            body = mutate(rnd, make()) if rnd.random() < 0.9 else make()
            headers = {"x-sla-class": rnd.choice(["interactive", "batch", "bogus"])} if rnd.random() < 0.2 else {}
            with client.stream("POST", path, json=body, headers=headers) as r:
                text = b"".join(r.iter_bytes()).decode("utf-8", "replace")
            tally.record(path, r.status_code, r.status_code >= 500, f"{text[:300]} BODY {json.dumps(body)[:300]}")


def fuzz_kserve(args: argparse.Namespace, rnd: random.Random, tally: Tally) -> None:
    import httpx
    import numpy as np
    models = _models(args.models)
    with httpx.Client(base_url=args.url, timeout=60) as client:
        for _ in range(args.n):
            name, inp, width = rnd.choice(models)
            body = _tensor_body(inp, width)
            body = mutate(rnd, body) if rnd.random() < 0.85 else body
            t = body.get("inputs", [None])[0] if isinstance(body.get("inputs"), list) and body["inputs"] else None
            if rnd.random() < 0.4 and isinstance(t, dict) and isinstance(t.get("data"), list):
                try:  # the binary-data extension: the tensor's bytes after the JSON header
                    raw = (struct.pack("<I", 5) + b"hello" if t.get("datatype") == "BYTES"
                           else np.asarray(t.pop("data"), dtype=np.float32).tobytes())
                except (TypeError, ValueError):
                    raw = b"\0" * rnd.randint(0, 9)
                t.pop("data", None)
                t["parameters"] = {"binary_data_size": rnd.choice([len(raw), len(raw) + 1, 0, -1, 2 ** 40])}
                header = json.dumps(body).encode()
                hlen = rnd.choice([len(header)] * 4 + [0, len(header) + 3, 2 ** 40])
                r = client.post(f"/v2/models/{name}/infer", content=header + raw,
                                headers={"Inference-Header-Content-Length": str(hlen)})
            else:
                r = client.post(f"/v2/models/{name}/infer", json=body)
            tally.record(f"infer {name}", r.status_code, r.status_code >= 500, f"{r.text[:300]} BODY {body}"[:600])


def fuzz_grpc(args: argparse.Namespace, rnd: random.Random, tally: Tally) -> None:
    import grpc
    import numpy as np

    from strataserve.api.proto import grpc_service_pb2 as pb
    from strataserve.api.proto import grpc_service_pb2_grpc as pbg
    stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(args.url))
    models = _models(args.models)
    for _ in range(args.n):
        name, inp, width = rnd.choice(models)
        req = pb.ModelInferRequest(model_name=name)
        t = req.inputs.add(name=inp, datatype="BYTES" if width is None else "FP32",
                           shape=[1] if width is None else [1, width])
        req.raw_input_contents.append(struct.pack("<I", 2) + b"hi" if width is None
                                      else np.ones(width, np.float32).tobytes())
        for _ in range(rnd.randint(0, 3)):
            edit = rnd.choice(["shape", "dtype", "name", "short", "long", "extra", "version", "output", "model"])
            if edit == "shape":
                del t.shape[:]
                t.shape.extend(rnd.choice([[], [0], [1, 4, 1], [2 ** 40, 4], [1, 10 ** 6]]))
            elif edit == "dtype":
                t.datatype = rnd.choice(["", "FP8", "BYTES", "INT64", "fp32"])
            elif edit == "name":
                t.name = rnd.choice(["", "nope", inp * 3])
            elif edit == "short":
                req.raw_input_contents[0] = req.raw_input_contents[0][: rnd.randint(0, 5)]
            elif edit == "long":
                req.raw_input_contents[0] += b"\x01" * rnd.randint(1, 13)
            elif edit == "extra":
                req.raw_input_contents.append(b"\0" * rnd.randint(0, 16))
            elif edit == "version":
                req.model_version = rnd.choice(["0", "-1", "99", "x"])
            elif edit == "output":
                req.outputs.add(name=rnd.choice(["nope", ""]))
            else:
                req.model_name = rnd.choice(["", "nope", "../x"])
        try:
            stub.ModelInfer(req, timeout=30)
            tally.record(f"grpc {name}", "OK", False, "")
        except grpc.RpcError as exc:
            code = exc.code().name
            tally.record(f"grpc {name}", code, code in ("INTERNAL", "UNKNOWN"), f"{exc.details()} | {req}")


def fuzz_speech(args: argparse.Namespace, rnd: random.Random, tally: Tally) -> None:
    import httpx
    choices = {"input": ["hello there", "", "é" * 50, "a" * 20000, 5], "voice": [args.voice, "nobody", "", None],
               "language": [args.language, "klingon", None], "response_format": ["wav", "pcm", "flac", "mp3", "opus"],
               "stream_format": ["audio", "sse", "x"], "speed": [1.0, 0.1, 5, -1],
               "temperature": [0, 0.5, -1, 1e308], "top_k": [0, 1, -1, 10 ** 9], "top_p": [0, 1, 1.5],
               "repetition_penalty": [0, 1, 2, -1], "seed": [0, -1, 2 ** 63 - 1], "max_new_frames": [1, 4, 0, -1],
               "instructions": ["be calm", "", "x" * 5000],
               "ref_audio": ["", "not base64!", base64.b64encode(b"RIFF0000WAVE").decode(), "/etc/passwd"],
               "num_step": [0, 1, -5], "guidance_scale": [0, -1, 1e308], "model": [args.models, "nope", ""]}
    with httpx.Client(base_url=args.url, timeout=120) as client:
        for _ in range(args.n):
            body = {"model": args.models, "input": "hello there", "voice": args.voice, "language": args.language,
                    "temperature": 0, "response_format": "wav"}
            # the base request must be valid: an autoregressive model is capped by frames, OmniVoice by steps
            body.update({"num_step": 4} if args.nar else {"max_new_frames": 4})
            for key in rnd.sample(sorted(choices), rnd.randint(0, 3)):
                body[key] = rnd.choice(choices[key])
            with client.stream("POST", "/v1/audio/speech", json=body) as r:
                data = b"".join(r.iter_bytes())
            tally.record("speech", r.status_code, r.status_code >= 500, f"{data[:300]!r} BODY {body}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=["openai", "kserve", "grpc", "speech"])
    ap.add_argument("url", help="http://HOST:PORT (gRPC: HOST:PORT)")
    ap.add_argument("--models", required=True)
    ap.add_argument("-n", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--voice", default="ryan")
    ap.add_argument("--language", default="english")
    ap.add_argument("--nar", action="store_true", help="speech: the model is non-autoregressive (OmniVoice)")
    args = ap.parse_args()
    rnd, tally = random.Random(args.seed), Tally()
    {"openai": fuzz_openai, "kserve": fuzz_kserve, "grpc": fuzz_grpc, "speech": fuzz_speech}[args.target](
        args, rnd, tally)
    return tally.report()


if __name__ == "__main__":
    sys.exit(main())
