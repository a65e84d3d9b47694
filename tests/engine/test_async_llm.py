"""AsyncLLM over InprocCoreClient and the fake runner: streaming deltas, abort on cancel, bad input, engine death."""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from engine_fakes import FakeRunner, engine_config, reference_output
from engine_tokenizer import build_tokenizer

from strataserve.engine.async_llm import AsyncLLM
from strataserve.types.errors import EngineDeadError
from strataserve.types.sampling import RequestOutputKind
from strataserve.types.sampling import SamplingParams as VllmSamplingParams

NUM_BLOCKS = 64


def SamplingParams(**kw) -> VllmSamplingParams:  # noqa: N802 - the server's kind: most tests here check deltas
    return VllmSamplingParams(output_kind=RequestOutputKind.DELTA, **kw)


def make(delay_s=0.0, fail_at_step=None, max_model_len=256, stream_interval=1) -> AsyncLLM:
    runner = FakeRunner(num_blocks=NUM_BLOCKS, block_size=4, max_model_len=max_model_len, delay_s=delay_s,
                        fail_at_step=fail_at_step)
    return AsyncLLM.from_config(engine_config(stream_interval=stream_interval), runner=runner,
                                tokenizer=build_tokenizer())


async def collect(llm, prompt, params, rid, **kw):
    texts, toks, outs = {}, {}, []
    async for out in llm.generate(prompt, params, rid, **kw):
        outs.append(out)
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
            toks[c.index] = toks.get(c.index, []) + c.token_ids
    return texts, toks, outs


async def text_streams_and_n2(llm, count: int, max_tokens: int, n2_tokens: int) -> list[list]:
    """``count`` text prompts and one n=2 token prompt streamed at once; checks every stream's tokens and text
    against the reference and returns the text streams' outputs (one list per prompt) for further checks."""
    tok = llm.tokenizer
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    results = await asyncio.gather(*[collect(llm, f"hello world {i}", sp, f"r{i}") for i in range(count)],
                                   collect(llm, [5, 6, 7], SamplingParams(n=2, max_tokens=n2_tokens, ignore_eos=True),
                                           "n2"))
    for i, (texts, toks, _) in enumerate(results[:count]):
        assert toks[0] == reference_output(tok.encode(f"hello world {i}"), max_tokens)
        assert texts[0] == tok.decode(toks[0])
    expected = reference_output([5, 6, 7], n2_tokens)
    assert results[count][1] == {0: expected, 1: expected}
    return [outs for _, _, outs in results[:count]]


async def wait_idle(llm, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        s = llm.stats
        if s is not None and s.num_free_blocks == NUM_BLOCKS and s.num_running == 0 and s.num_waiting == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {llm.stats}")


def test_streams_deltas_concurrently_and_matches_reference():
    async def main():
        llm = make()
        try:
            for outs in await text_streams_and_n2(llm, 6, 12, 4):
                assert [o.finished for o in outs][-1] and not any(o.finished for o in outs[:-1])
                assert outs[-1].outputs[0].finish_reason == "length"
            await wait_idle(llm)
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_cancelling_the_consumer_aborts_the_request_and_frees_blocks():
    async def main():
        llm = make(delay_s=0.005)
        try:
            got = asyncio.Event()

            async def consume():
                async for _ in llm.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True), "c"):
                    got.set()

            task = asyncio.create_task(consume())
            await got.wait()
            assert llm.stats.num_free_blocks < NUM_BLOCKS
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await wait_idle(llm)
            # aclose() (a consumer that stops iterating) aborts too.
            gen = llm.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "d")
            await gen.__anext__()
            await gen.aclose()
            await wait_idle(llm)
            # The id is free again and the engine keeps serving.
            _, toks, _ = await collect(llm, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "c")
            assert toks[0] == reference_output([5, 6, 7], 3)
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_abort_from_another_task_ends_the_stream_with_abort():
    async def main():
        llm = make(delay_s=0.005)
        try:
            gen = llm.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "x")
            first = await gen.__anext__()
            assert not first.finished
            await llm.abort("x")
            rest = [o async for o in gen]
            assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
            # the last output is shaped as every other (its prompt and metrics were missing)
            assert rest[-1].prompt_token_ids == first.prompt_token_ids == [5, 6, 7]
            assert rest[-1].metrics is not None
            await wait_idle(llm)
            await llm.abort("never-existed")
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_stop_string_finishes_stream_and_core_request():
    async def main():
        llm = make()
        try:
            sp = SamplingParams(max_tokens=60, ignore_eos=True)
            full, _, _ = await collect(llm, [5, 6, 7], sp, "full")
            stop = full[0][12:15]
            texts, toks, outs = await collect(llm, [5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop]), "s")
            assert texts[0] == full[0][:full[0].index(stop)]
            assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
            assert len(toks[0]) < 60
            await wait_idle(llm)
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_bad_input_is_rejected_and_others_keep_running():
    async def main():
        llm = make(max_model_len=32)
        try:
            ok = asyncio.create_task(collect(llm, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), "ok"))
            for prompt, match in [([], "empty"), (list(range(3, 40)), "max_model_len"), ("", "empty"),
                                  ([5, -1], "out of range"), (3.5, "must be a string")]:
                with pytest.raises(ValueError, match=match):
                    await collect(llm, prompt, SamplingParams(), "bad")
            with pytest.raises(ValueError, match="SamplingParams"):
                await collect(llm, [5], {"max_tokens": 3}, "bad")
            _, toks, _ = await ok
            assert toks[0] == reference_output([5, 6, 7], 8)
            # max_tokens beyond the context is clipped to what is left.
            _, toks, outs = await collect(llm, list(range(3, 23)), SamplingParams(max_tokens=100, ignore_eos=True), "clip")
            assert len(toks[0]) == 12 and outs[-1].outputs[0].finish_reason == "length"
            await wait_idle(llm)
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_engine_death_fails_streams_and_reports_unhealthy():
    async def main():
        llm = make(fail_at_step=3)
        try:
            with pytest.raises(EngineDeadError):
                await collect(llm, [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), "boom")
            assert llm.errored
            with pytest.raises(EngineDeadError):
                llm.check_health()
            with pytest.raises(EngineDeadError):
                await collect(llm, [5, 6, 7], SamplingParams(max_tokens=5), "after")
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_shutdown_leaves_no_threads():
    before = {t.ident for t in threading.enumerate()}

    async def main():
        llm = make()
        await collect(llm, [5, 6], SamplingParams(max_tokens=2, ignore_eos=True), "a")
        llm.shutdown()
        llm.shutdown()

    asyncio.run(main())
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before


@pytest.mark.parametrize("interval", [3, 5])
def test_stream_interval_sends_the_first_token_at_once_then_groups(interval):
    """``stream_interval``: the first delta is the first token alone, every later one but the last carries at
    least ``interval`` tokens, and the tokens and text are the same as streaming each token."""
    async def main():
        llm = make(delay_s=0.002, stream_interval=interval)
        try:
            for outs in await text_streams_and_n2(llm, 4, 17, 9):
                sizes = [len(o.outputs[0].token_ids) for o in outs]
                assert sizes[0] == 1 and all(s >= interval for s in sizes[1:-1]), sizes
                assert len(outs) <= 2 + (17 - 1) // interval and outs[-1].finished
            await wait_idle(llm)
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        engine_config(stream_interval=0)


def test_cumulative_and_final_only_kinds_as_vllm():
    """vLLM's default kind is CUMULATIVE: each output holds the text and ids so far (the last, the whole
    completion); FINAL_ONLY yields just that last one. Both equal the deltas summed."""
    async def run():
        llm = make()
        try:
            _, deltas, _ = await collect(llm, [5, 6, 7], SamplingParams(n=2, max_tokens=6, ignore_eos=True), "d")
            kinds = {}
            for kind in (None, RequestOutputKind.FINAL_ONLY):
                extra = {} if kind is None else {"output_kind": kind}
                params = VllmSamplingParams(n=2, max_tokens=6, ignore_eos=True, **extra)
                kinds[kind] = [out async for out in llm.generate([5, 6, 7], params, f"k{kind}")]
            return deltas, kinds
        finally:
            llm.shutdown()

    deltas, kinds = asyncio.run(run())
    cumulative, final = kinds[None], kinds[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished and len(cumulative) >= 6
    lengths = [len(out.outputs[0].token_ids) for out in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] == 6  # growing, never reset
    for last in (cumulative[-1], final[0]):
        assert [c.token_ids for c in last.outputs] == [deltas[0], deltas[1]]
