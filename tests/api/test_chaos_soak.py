"""A short chaos soak (fixed seed, bounded): a few hundred greedy requests mixing the API's features (completions
and chat, n, stop strings, logit bias, penalties, logprobs, echo, token-id prompts, structured outputs with text
that JSON and grammars escape, tools with every tool_choice, tool-call history), streamed at concurrency 48 on a
48-block KV pool (so some requests are preempted and recomputed), a fifth of them hung up mid-stream. Every
stream that completes must equal the same request sent alone afterwards, not streamed (text, finish reason, tool
calls, token ids); a finished constrained output must keep its constraint; every SSE event must be one line even to
splitlines-based readers; and the server must end idle with every KV block back. Longer runs of this soak found
the U+2028 / U+0085 SSE break and xgrammar's escape bug (this test fails on either, put back).
"""
from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import pytest

from api_server import MODEL, launch

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5},
                                           "c": {"enum": ["a\x85c", "\u2028"]}}, "required": ["a", "c"]}
WORDS = ["w", "x", "héllo", "ü", "\u2028", "日本", "a\x85c", "\n", "\t", "{"]


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(99)) for _ in range(rng.randrange(lo, hi)))


def _request(rng: random.Random) -> tuple[str, dict]:
    kind = rng.choice(["cmpl", "cmpl_multi", "tokens", "guided", "chat", "chat_tools", "chat_history"])
    body: dict = {"model": MODEL, "max_tokens": rng.choice([1, 3, 16, 48]), "temperature": 0}
    if rng.random() < 0.25:
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        body["stop"] = rng.choice([["w1"], [" ", "é"], ["\n\n", "xyz"], "ab"])
    if rng.random() < 0.15:
        body["logit_bias"] = {str(rng.randrange(5, 260)): rng.choice([5.0, -100.0])}
    if rng.random() < 0.15:
        body["repetition_penalty"] = 1.3
    if rng.random() < 0.1:
        body["include_stop_str_in_output"] = True
    if rng.random() < 0.2:
        body["return_token_ids"] = True
    if kind in ("cmpl", "cmpl_multi", "tokens", "guided"):
        if kind == "tokens":
            body["prompt"] = [rng.randrange(5, 500) for _ in range(rng.randrange(1, 60))]
        elif kind == "cmpl_multi":
            body["prompt"] = [_words(rng, 1, 8) for _ in range(rng.randrange(1, 4))]
        else:
            body["prompt"] = _words(rng, 1, 20)
        if rng.random() < 0.2:
            body["logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.15:
            body["echo"] = True
        if kind == "guided":
            guided = rng.choice([{"guided_json": SCHEMA}, {"guided_choice": ["yes", "w7 \u2028", "a\x85c"]},
                                 {"guided_regex": r"w[0-9]{1,3}( w[0-9]{1,3}){0,3}"},
                                 {"response_format": {"type": "json_object"}}])
            body.update(guided)
        return "/v1/completions", body
    messages = [{"role": "user", "content": _words(rng, 1, 15)}]
    if kind == "chat_history":
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        body["tools"] = TOOLS
    body["messages"] = messages
    if rng.random() < 0.2:
        body["logprobs"] = True
        body["top_logprobs"] = rng.choice([0, 2])
    if kind == "chat_tools":
        body["tools"] = TOOLS
        body["tool_choice"] = rng.choice(["auto", "required", "none",
                                          {"type": "function", "function": {"name": "get_weather"}}])
    elif rng.random() < 0.1:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    return "/v1/chat/completions", body


def _from_stream(events: list[dict]) -> dict:
    out: dict = {}
    for e in events:
        for c in e.get("choices", []):
            o = out.setdefault(c["index"], {"text": "", "finish": None, "tools": {}, "ids": []})
            o["ids"] += c.get("token_ids") or []
            if "delta" in c:
                o["text"] += c["delta"].get("content") or ""
                for tc in c["delta"].get("tool_calls") or []:
                    t = o["tools"].setdefault(tc["index"], ["", ""])
                    f = tc.get("function") or {}
                    t[0] += f.get("name") or ""
                    t[1] += f.get("arguments") or ""
            else:
                o["text"] += c.get("text") or ""
            o["finish"] = c.get("finish_reason") or o["finish"]
    return {i: (o["text"], o["finish"], [tuple(t) for _, t in sorted(o["tools"].items())], o["ids"])
            for i, o in out.items()}


def _from_body(doc: dict) -> dict:
    out = {}
    for c in doc["choices"]:
        if "message" in c:
            m = c["message"]
            calls = [(t["function"]["name"], t["function"]["arguments"]) for t in m.get("tool_calls") or []]
            out[c["index"]] = (m.get("content") or "", c["finish_reason"], calls, c.get("token_ids") or [])
        else:
            out[c["index"]] = (c["text"], c["finish_reason"], [], c.get("token_ids") or [])
    return out


def _constraint_errors(body: dict, outputs: dict) -> list[str]:
    """What a finished constrained output breaks (a choice not chosen, JSON off its schema, a regex unmatched)."""
    fmt = body.get("response_format") or {}
    schema = body.get("guided_json") or (fmt.get("json_schema") or {}).get("schema")
    errors = []
    for text, finish, _, _ in outputs.values():
        if finish != "stop" or body.get("stop") or body.get("echo"):
            continue  # cut by length or a stop string, or after the echoed prompt: not the constrained output alone
        if "guided_choice" in body and text not in body["guided_choice"]:
            errors.append(f"{text!r} is no choice")
        if "guided_regex" in body and not re.fullmatch(body["guided_regex"], text):
            errors.append(f"{text!r} does not match")
        if schema is not None or fmt.get("type") == "json_object":
            try:
                doc = json.loads(text)
                if schema is not None:
                    jsonschema.validate(doc, schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                errors.append(f"{text!r}: {str(exc)[:100]}")
    return errors


async def _soak(url: str, headers: dict, total: int, concurrency: int) -> tuple[dict, list, list]:
    rng = random.Random(20261204)
    seeds = [rng.random() for _ in range(total)]
    stats: dict = {}
    done: list = []
    problems: list = []
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, seed: float) -> None:
        r_ = random.Random(seed)
        path, body = _request(r_)
        hang_after = r_.randrange(1, 5) if r_.random() < 0.2 else None
        async with gate, client.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                stats[r.status_code] = stats.get(r.status_code, 0) + 1
                if r.status_code >= 500:
                    problems.append(f"{r.status_code} {r.text[:200]} {json.dumps(body)[:200]}")
                return
            events, buf = [], b""
            async for chunk in r.aiter_bytes():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: ") or len(event.decode().splitlines()) != 1:
                        problems.append(f"not one line to splitlines-based readers: {event[:120]!r}")
                    elif event != b"data: [DONE]":
                        doc = json.loads(event[6:])
                        if "error" in doc:
                            problems.append(f"stream error {doc} {json.dumps(body)[:200]}")
                        events.append(doc)
                if hang_after is not None and len(events) >= hang_after:
                    stats["hung up"] = stats.get("hung up", 0) + 1
                    return
            stats[200] = stats.get(200, 0) + 1
            done.append((path, body, _from_stream(events)))

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        await asyncio.gather(*(one(client, s) for s in seeds))
        mismatches = []
        for path, body, streamed in done:
            r = await client.post(path, json=body)
            if r.status_code != 200 or _from_body(r.json()) != streamed:
                mismatches.append((json.dumps(body)[:300], streamed, r.text[:300]))
            problems += [f"constraint broken: {p} {json.dumps(body)[:200]}" for p in _constraint_errors(body, streamed)]
        for _ in range(100):  # hung-up streams are aborted at the next step boundary
            text = (await client.get("/metrics")).text
            held = [float(v) for v in re.findall(
                r'^strata:(?:num_requests_running|num_requests_waiting|kv_cache_used_blocks)\{[^}]*\} (\S+)', text,
                re.M)]
            if len(held) == 3 and not any(held):
                break
            await asyncio.sleep(0.2)
        stats["held at the end"] = held
        stats["preemptions"] = sum(float(v) for v in re.findall(r'^strata:num_preemptions(?:_total)?\{[^}]*\} (\S+)',
                                                                text, re.M))
    return stats, done, problems + [f"stream != alone: {m}" for m in mismatches]


@pytest.fixture(scope="module")
def soak_server(tiny_ckpt, tmp_path_factory):
    srv = launch(tiny_ckpt, tmp_path_factory.mktemp("soak") / "server.log", "--max-num-seqs", "16",
                 "--num-gpu-blocks-override", "48", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield srv
    finally:
        srv.stop()


def test_mixed_streams_equal_solo_runs_and_nothing_leaks(soak_server):
    stats, done, problems = asyncio.run(_soak(soak_server.url, soak_server.headers, total=320, concurrency=48))
    assert not problems, problems[:5]
    assert len(done) >= 200 and stats.get("hung up", 0) >= 30, stats  # the mix really ran, and really hung up
    assert set(stats) <= {200, 400, "hung up", "held at the end", "preemptions"}, stats  # 400: a prompt too long
    assert stats["preemptions"] > 0, stats  # the 48-block pool made the scheduler recompute some requests
    assert stats["held at the end"] == [0.0, 0.0, 0.0], stats
    assert "Traceback" not in soak_server.log.read_text(errors="replace")
