"""``POST /v1/completions``: prompts as text, text list, token ids or token-id lists (vLLM style), n, echo,
logprobs, streaming with ``stream_options.include_usage``."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from strataserve.api.errors import bad_request
from strataserve.api.formatting import (ChunkTemplate, CompletionLogprobs, TokenNamer, json_bytes, sse, usage,
                                      vllm_prompt_logprobs)
from strataserve.api.guided import guided_params
from strataserve.api.protocol import CompletionRequest
from strataserve.api.request_params import (check_prompt_logprobs, check_token_ids, make_params, resolve_max_tokens,
                                           truncated, vllm_extras)
from strataserve.api.serving import (ServerState, admit, counts_outcome, engine_abort_error, engine_stream, forward,
                                     merge_streams, new_id, sse_body, traced, until_disconnect)
from strataserve.router.metrics import RouteTrace
from strataserve.types.sampling import SamplingParams

router = APIRouter()


def _prompts(state: ServerState, prompt: Any, special: bool = True) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt; ``special``: the tokenizer adds its special tokens to text."""
    if state.tokenizer is None and (isinstance(prompt, str) or (prompt and isinstance(prompt[0], str))):
        raise bad_request("this server runs without a tokenizer (--skip-tokenizer-init): give token ids as the "
                          "prompt", param="prompt")
    if isinstance(prompt, str):
        return [(prompt, state.tokenizer.encode(prompt, add_special_tokens=special))]
    if not prompt:
        raise bad_request("prompt is empty: give a string, a list of strings or token ids", param="prompt")
    if isinstance(prompt[0], str):
        return [(p, state.tokenizer.encode(p, add_special_tokens=special)) for p in prompt]
    if isinstance(prompt[0], int):
        check_token_ids(state, prompt)
        return [(None, list(prompt))]
    for ids in prompt:
        check_token_ids(state, ids)
    return [(None, list(ids)) for ids in prompt]


class _Choice:
    __slots__ = ("parts", "num_tokens", "finish_reason", "stop_reason", "logprobs", "token_ids")

    def __init__(self, logprobs: CompletionLogprobs | None) -> None:
        self.parts: list[str] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.logprobs = logprobs
        self.token_ids: list[int] = []


@router.post("/v1/completions")
@counts_outcome
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    routed = admit(request, body)
    if routed.upstream:
        return await forward(routed, request, "/v1/completions", stream=body.stream, prefix=_prefix(body.prompt))
    state = routed.state
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of different from n is not supported", param="best_of")
    check_prompt_logprobs(body)
    prompts = _prompts(state, body.prompt, body.add_special_tokens)
    if body.truncate_prompt_tokens is not None:  # an echo of a cut prompt shows the tokens kept
        cut = [truncated(state, ids, body.truncate_prompt_tokens) for _, ids in prompts]
        prompts = [(text if len(kept) == len(ids) else None, kept) for (text, ids), kept in zip(prompts, cut)]
    if state.tokenizer is None and (body.echo or body.logprobs is not None or body.stop):
        raise bad_request("echo, logprobs and stop strings need a tokenizer; this server has none "
                          "(--skip-tokenizer-init): read the token ids (return_token_ids)", param="prompt")
    common = dict(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                  repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop or None,
                  stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                  logprobs=body.logprobs, skip_special_tokens=body.skip_special_tokens,
                  include_stop_str_in_output=body.include_stop_str_in_output, guided_decoding=guided_params(body),
                  prompt_logprobs=_engine_prompt_logprobs(body), logit_bias=body.logit_bias,
                  **vllm_extras(state, body))
    params: list[SamplingParams] = []
    for _, ids in prompts:
        # echo with max_tokens 0 scores the prompt (vLLM, after OpenAI): one token is made and thrown away
        max_tokens = resolve_max_tokens(state, len(ids), 1 if _echo_only(body) else body.max_tokens, "max_tokens")
        params.append(make_params(state.sampling_defaults, max_tokens=max_tokens, **common))
    num_seqs = body.n * len(prompts)
    rid = new_id("cmpl")
    work = float(sum(len(ids) for _, ids in prompts))  # prompt tokens to prefill (siblings share them)
    # 429 when the key's tokens per minute are spent or the queue ahead would make it miss its class's TTFT
    routed.check(work, work + body.n * sum(p.max_tokens for p in params), num_seqs,
                 max(p.max_tokens for p in params))
    if body.stream:
        state.check_capacity(num_seqs)  # refuse now (503) rather than after the 200 has gone out
        events = _events(state, body, rid, prompts, params, routed.priority(body.priority))
        return StreamingResponse(sse_body(state, num_seqs, routed, work, events), media_type="text/event-stream")
    with state.admit(num_seqs), traced(routed.trace(work)) as trace:
        result = await until_disconnect(request, _collect(state, body, rid, prompts, params,
                                                          (routed.priority(body.priority), trace)))
    return Response(json_bytes(result), media_type="application/json")


def _prefix(prompt: Any) -> str | None:
    """What replica affinity hashes: the (first) prompt's text."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return prompt[0]
    return None


def _streams(state: ServerState, rid: str, prompts: list, params: list, job: tuple, prompt_only: bool) -> list:
    priority, trace = job
    streams = [engine_stream(state, f"{rid}-{i}", ids, p, priority, trace)
               for i, ((_, ids), p) in enumerate(zip(prompts, params))]
    return [_without_output(s) for s in streams] if prompt_only else streams


def _echo_only(body: CompletionRequest) -> bool:
    return body.echo and body.max_tokens == 0


async def _without_output(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """An engine stream with its generated tokens left out (``_echo_only``): the prompt's logprobs stay, and each
    choice ends with ``length`` (its budget, 0, was spent)."""
    try:
        async for out in stream:
            out.outputs = [c if c.finish_reason == "abort" else
                           dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None, stop_reason=None,
                                               logprobs=None if c.logprobs is None else [],
                                               finish_reason=c.finish_reason and "length")
                           for c in out.outputs]
            yield out
    finally:
        await stream.aclose()  # an early exit aborts the engine request


def _echo_text(state: ServerState, text: str | None, ids: list[int]) -> str:
    return text if text is not None else state.tokenizer.decode(ids)


def _token_ids(body: CompletionRequest, prompt_ids: list[int], ids: list[int]) -> dict[str, list[int]]:
    """vLLM's ``return_token_ids``: the prompt's and the completion's token ids in each choice."""
    return {"prompt_token_ids": prompt_ids, "token_ids": ids} if body.return_token_ids else {}


def _engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """The prompt logprobs the engine computes: for an echo with logprobs, for ``prompt_logprobs``, or both."""
    wanted = [v for v in (body.logprobs if _echo_logprobs(body) else None, body.prompt_logprobs) if v is not None]
    return max(wanted) if wanted else None


def _echo_logprobs(body: CompletionRequest) -> bool:
    """echo with logprobs: the logprobs cover the prompt tokens too (the engine's prompt_logprobs)."""
    return body.echo and body.logprobs is not None


def _add_prompt_logprobs(logprobs: list, first: int, n: int, echoed: str, ids: list[int], out: Any) -> list[Any]:
    """Put the prompt's logprobs first in the n choices' logprobs starting at index ``first`` (the engine's first
    output carries them); returns each choice's part, for a stream chunk. ``echoed``: the prompt's text."""
    return [logprobs[first + i].add(ids, out.prompt_logprobs, echoed) for i in range(n)]


async def _collect(state: ServerState, body: CompletionRequest, rid: str, prompts: list,
                   params: list, job: tuple) -> dict[str, Any]:
    n = body.n
    namer = TokenNamer(state.tokenizer)
    choices: list[_Choice] = []
    echoes = [_echo_text(state, text, ids) if body.echo else "" for text, ids in prompts]
    for prefix in echoes:
        for _ in range(n):
            lp = (CompletionLogprobs(namer, body.logprobs, 0 if _echo_logprobs(body) else len(prefix),
                                     body.skip_special_tokens) if body.logprobs is not None else None)
            choice = _Choice(lp)
            if prefix:
                choice.parts.append(prefix)
            choices.append(choice)
    prompt_lps: dict[int, list | None] = {}
    async for pi, out in merge_streams(_streams(state, rid, prompts, params, job, _echo_only(body))):
        if out.prompt_logprobs is not None:
            prompt_lps[pi] = out.prompt_logprobs
        if _echo_logprobs(body) and out.prompt_logprobs is not None:
            _add_prompt_logprobs([ch.logprobs for ch in choices], pi * n, n, echoes[pi], prompts[pi][1], out)
        for c in out.outputs:
            ch = choices[pi * n + c.index]
            ch.parts.append(c.text)
            ch.num_tokens += len(c.token_ids)
            ch.token_ids.extend(c.token_ids)
            if ch.logprobs is not None:
                ch.logprobs.add(c.token_ids, c.logprobs)
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
    for ch in choices:
        if ch.finish_reason == "abort":
            raise engine_abort_error(ch.stop_reason)
    plps = None if body.prompt_logprobs is None else [  # one list per prompt, shared by its n choices
        vllm_prompt_logprobs(namer, ids, prompt_lps.get(pi), body.prompt_logprobs)
        for pi, (_, ids) in enumerate(prompts)]
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": [{"index": k, "text": "".join(ch.parts), "finish_reason": ch.finish_reason,
                     "stop_reason": ch.stop_reason,
                     "logprobs": ch.logprobs.result() if ch.logprobs is not None else None,
                     **({"prompt_logprobs": plps[k // n]} if plps is not None else {}),
                     **_token_ids(body, prompts[k // n][1], ch.token_ids)}
                    for k, ch in enumerate(choices)],
        "usage": usage(sum(len(ids) for _, ids in prompts), sum(ch.num_tokens for ch in choices)),
    }


def _events(state: ServerState, body: CompletionRequest, rid: str, prompts: list, params: list,
            priority: int) -> Callable[[RouteTrace], AsyncIterator[bytes]]:
    async def events(trace: RouteTrace) -> AsyncIterator[bytes]:
        n = body.n
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        head: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()),
                                "model": state.model_name}
        if with_usage:
            head["usage"] = None
        # continuous_usage_stats (vLLM): every chunk carries the usage so far
        continuous = with_usage and body.stream_options.continuous_usage_stats
        total_prompt = sum(len(ids) for _, ids in prompts)
        namer = TokenNamer(state.tokenizer)
        logprobs: list[CompletionLogprobs | None] = []
        completion_tokens = 0
        for pi, (text, ids) in enumerate(prompts):
            prefix = _echo_text(state, text, ids) if body.echo else ""
            for i in range(n):
                logprobs.append(CompletionLogprobs(namer, body.logprobs, 0 if _echo_logprobs(body) else len(prefix),
                                                   body.skip_special_tokens) if body.logprobs is not None else None)
                if prefix and not _echo_logprobs(body):  # else sent with the prompt's logprobs, below
                    yield sse({**head, "choices": [{"index": pi * n + i, "text": prefix, "logprobs": None,
                                                    "finish_reason": None}],
                               **({"usage": usage(total_prompt, 0)} if continuous else {})})
        chunk = ChunkTemplate(head, (lambda: usage(total_prompt, completion_tokens)) if continuous else None).text
        # return_token_ids (vLLM): each chunk carries its new token ids, a choice's first one the prompt's too: the
        # only output of a server without a tokenizer (--skip-tokenizer-init)
        ids_unsent = set(range(len(prompts) * n)) if body.return_token_ids else set()
        streams = _streams(state, rid, prompts, params, (priority, trace), _echo_only(body))
        single = len(streams) == 1  # the usual case: no merge, one generator hop less per token
        async for item in (streams[0] if single else merge_streams(streams)):
            pi, out = (0, item) if single else item
            batch = []  # one write per engine output, however many choices it advanced
            if _echo_logprobs(body) and out.prompt_logprobs is not None:
                echoed = _echo_text(state, *prompts[pi])
                for i, part in enumerate(_add_prompt_logprobs(logprobs, pi * n, n, echoed, prompts[pi][1], out)):
                    batch.append(chunk(pi * n + i, echoed, part, None))
            for c in out.outputs:
                k = pi * n + c.index
                completion_tokens += len(c.token_ids)
                if c.finish_reason == "abort":
                    raise engine_abort_error(c.stop_reason)
                lp = logprobs[k]
                lp_part = lp.add(c.token_ids, c.logprobs) if lp is not None else None
                token_ids = None
                if body.return_token_ids:
                    token_ids = {"prompt_token_ids": prompts[pi][1]} if k in ids_unsent else {}
                    token_ids["token_ids"] = c.token_ids
                    ids_unsent.discard(k)
                elif not c.text and c.finish_reason is None and lp_part is None:
                    continue  # an incomplete multi-byte character: nothing to show yet
                if c.finish_reason is not None:  # the last chunk says which stop ended it, as vLLM's does
                    token_ids = {**(token_ids or {}), "stop_reason": c.stop_reason}
                batch.append(chunk(k, c.text, lp_part, c.finish_reason, token_ids))
            if batch:
                yield b"".join(batch)
        if with_usage:
            yield sse({**head, "choices": [], "usage": usage(total_prompt, completion_tokens)})

    return events
