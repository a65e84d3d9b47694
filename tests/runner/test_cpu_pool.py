"""The CPU engine's work-sharing pool (``runner/cpu_pool.c`` behind ``cpu_pool.py``): its matmuls equal
``F.linear`` bit for bit; a worker that stalls mid-job does not hold up the chunks nobody has started; concurrent
callers, a forked child and the engine (torch held at one thread while stepping, released when idle) all work."""
from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
import torch
from _tiny_models import make_tiny_checkpoint

from strataserve import LLM, SamplingParams, envs
from strataserve.runner import cpu_kernel, cpu_pool

POOL = cpu_pool.get()  # two cores in CI and torch's MKL: a None here fails the tests


@pytest.mark.parametrize("m", [1, 2, 7, 64, 300, 700])
@pytest.mark.parametrize("n,k", [(512, 256), (1376, 256), (256, 688), (100, 33)])
def test_linear_equals_f_linear_bit_for_bit(m, n, k):
    assert POOL is not None and POOL.threads >= 2
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k + 5, generator=gen)[:, :k]  # rows `k + 5` apart: the pool reads through the row stride
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    assert torch.equal(POOL.linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(POOL.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_linear_declines_what_it_does_not_take():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    assert POOL.linear(x.bfloat16(), w.bfloat16()) is None
    assert POOL.linear(x.t().contiguous().t(), w) is None  # columns not contiguous
    assert POOL.linear(x, torch.randn(8, 6).t()) is None  # weight not contiguous
    assert POOL.linear(x, w, torch.randn(6).double()) is None
    assert POOL.linear(torch.randn(0, 8), w) is None


@pytest.mark.parametrize("m,n,threads", [(1, 512, 2), (64, 4096, 2), (300, 1376, 2), (2048, 1376, 2), (64, 20, 4)])
def test_tiles_split_decode_by_columns_and_long_prompts_both_ways(m, n, threads):
    mc, nc = cpu_pool.tile_shape(m, n, threads)
    assert 1 <= mc <= m and 1 <= nc <= n and (nc == n or nc % 16 == 0)
    assert -(-m // mc) * -(-n // nc) >= 2  # something to share
    if m <= 64 and n >= 512:
        assert mc == m  # a decode step's rows stay whole: x is small, and re-packing w per row block would cost more
    if m >= 2048:
        assert mc < m and nc < n  # a long prompt: re-packing all of x per column tile would cost more


_CHUNK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)


def test_a_stalled_worker_does_not_hold_up_the_other_chunks():
    """The worker blocks inside the first chunk it takes. The caller must run every other chunk meanwhile (with
    OpenMP's static split it would wait at the barrier with half of them undone); only then is the worker let go."""
    n = 64
    main = threading.get_ident()
    ran: list[tuple[int, int]] = []
    worker_in, let_go = threading.Event(), threading.Event()
    lock = threading.Lock()

    def chunk(_ctx, c):
        with lock:
            ran.append((c, threading.get_ident()))
        if threading.get_ident() != main:
            worker_in.set()
            let_go.wait(30)
        elif len(ran) == 1:
            worker_in.wait(30)  # make sure the worker holds a chunk before the caller goes on

    def release_when_the_caller_is_done():
        deadline = time.monotonic() + 30  # a guard against a hang, not a speed bound
        while time.monotonic() < deadline:
            with lock:
                if sum(t == main for _, t in ran) == n - 1:
                    break
            time.sleep(0.005)
        let_go.set()

    releaser = threading.Thread(target=release_when_the_caller_is_done)
    releaser.start()
    fn = _CHUNK(chunk)
    POOL._lib.strata_pool_run(ctypes.cast(fn, ctypes.c_void_p), None, n)
    releaser.join()
    assert sorted(c for c, _ in ran) == list(range(n))  # every chunk once
    assert sum(t != main for _, t in ran) == 1 and sum(t == main for _, t in ran) == n - 1


def test_concurrent_callers_and_the_c_kernels_share_it():
    """Two threads at once (two engines in one process): the second runs its own chunks itself."""
    w = torch.randn(1376, 256)
    xs = [torch.randn(64, 256) for _ in range(2)]
    want = [torch.nn.functional.linear(x, w) for x in xs]
    bad: list[int] = []

    def loop(i):
        for _ in range(200):
            if not torch.equal(POOL.linear(xs[i], w), want[i]):
                bad.append(i)

    ts = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
    assert cpu_kernel.load() is not None and cpu_kernel.load_layer_ops() is not None  # handed the pool at start


def test_a_forked_child_gets_right_results_without_hanging():
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    want = torch.nn.functional.linear(x, w)
    pid = os.fork()
    if pid == 0:  # the workers did not survive the fork: the child must neither wait for them nor fail
        ok = torch.equal(POOL.linear(x, w), want)
        os._exit(0 if ok else 3)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def test_the_engine_steps_on_the_pool_and_gives_torch_back(tmp_path, monkeypatch, two_threads):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "m")
    before = torch.get_num_threads()
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu", block_size=4, num_blocks=128)
    core = llm.engine.core
    assert core.runner.cpu_pool is POOL and core.cpu_pool is POOL and core.thread_governor is None
    seen: list[int] = []
    step = core._step

    def spy():
        seen.append(torch.get_num_threads())
        return step()

    monkeypatch.setattr(core, "_step", spy)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["hello world", "the quick brown fox"], params)
    assert seen and set(seen) == {1}  # held at one thread while stepping: no OpenMP worker beside the pool's
    assert torch.get_num_threads() == before  # ... and given back once idle
    # a sampled (not greedy) step's sampler gets torch's own count back for its sort / softmax over the vocabulary
    sampler_threads: list[int] = []
    sample = core.runner.sampler.__call__

    def spy_sampler(logits, reqs):
        sampler_threads.append(torch.get_num_threads())
        return sample(logits, reqs)

    monkeypatch.setattr(core.runner, "sampler", spy_sampler)
    seen.clear()
    llm.generate(["hello world"], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=1))
    assert sampler_threads and set(sampler_threads) == {before} and set(seen) == {1}
    assert torch.get_num_threads() == before
    monkeypatch.setattr(envs, "STRATA_CPU_POOL", False)
    monkeypatch.setattr(cpu_pool, "get", cpu_pool.get.__wrapped__)  # decide afresh: switched off
    off = LLM(model=str(ckpt), dtype="float32", device="cpu", block_size=4, num_blocks=128)
    assert off.engine.core.runner.cpu_pool is None and off.engine.core.thread_governor is not None
    assert [o.outputs[0].token_ids for o in off.generate(["hello world", "the quick brown fox"], params)] == \
        [o.outputs[0].token_ids for o in outs]
    monkeypatch.setattr(cpu_pool, "get", lambda: POOL)
    bf16 = LLM(model=str(ckpt), dtype="bfloat16", device="cpu", block_size=4, num_blocks=128)
    assert bf16.engine.core.cpu_pool is None and bf16.engine.core.thread_governor is not None  # float32 only
    bf16.generate(["hello world"], params)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("m", [2, 17, 64, 256])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1376, 256), (100, 33)])
def test_packed_weights_match_f_linear(m, n, k, monkeypatch):
    """STRATA_CPU_PACKED_WEIGHTS: 2-256 rows run over the weight packed once (MKL's cblas_sgemm_pack / compute).
    Not bit-identical to F.linear, but within float32 rounding of it, bias and strided rows included."""
    if cpu_kernel.mkl_packing() is None:
        pytest.skip("torch's MKL has no packed GEMM here")
    monkeypatch.setattr(envs, "STRATA_CPU_PACKED_WEIGHTS", True)
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k + 3, generator=gen)[:, :k]
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    ref, ref_b = torch.nn.functional.linear(x, w), torch.nn.functional.linear(x, w, b)
    got = POOL.linear(x, w)
    assert POOL.is_packed(w)  # the packed route ran
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5 * k ** 0.5)
    torch.testing.assert_close(POOL.linear(x, w, b), ref_b, rtol=1e-5, atol=2e-5 * k ** 0.5)


def test_packed_weights_follow_in_place_writes_and_leave_other_row_counts_alone(monkeypatch):
    if cpu_kernel.mkl_packing() is None:
        pytest.skip("torch's MKL has no packed GEMM here")
    monkeypatch.setattr(envs, "STRATA_CPU_PACKED_WEIGHTS", True)
    x, w = torch.randn(8, 64), torch.randn(96, 64)
    first = POOL.linear(x, w)
    w.mul_(-2.0)  # a weight reloaded in place must not be served from its old packing
    torch.testing.assert_close(POOL.linear(x, w), -2.0 * first, rtol=1e-5, atol=1e-4)
    one, many = torch.randn(1, 64), torch.randn(257, 64)  # one row and more than 256: MKL's own sgemm, exact
    assert torch.equal(POOL.linear(one, w), torch.nn.functional.linear(one, w))
    assert torch.equal(POOL.linear(many, w), torch.nn.functional.linear(many, w))
    with torch.inference_mode():  # an inference tensor counts no writes: never packed, MKL's own sgemm
        wi = torch.randn(96, 64)
    assert torch.equal(POOL.linear(x, wi), torch.nn.functional.linear(x, wi)) and not POOL.is_packed(wi)
    import copy
    import pickle

    clone = copy.deepcopy(w)  # nothing rides on the tensor: a copy is packed afresh, a pickle carries no pointers
    assert not POOL.is_packed(clone) and torch.equal(pickle.loads(pickle.dumps(w)), w)
    torch.testing.assert_close(POOL.linear(x, clone), POOL.linear(x, w), rtol=0, atol=0)
    held = len(POOL._packed_weights)
    del w, clone  # the packed copies go with their weights: nothing leaks across engines in one process
    assert len(POOL._packed_weights) == held - 2


def test_the_engine_with_packed_weights_matches_hf_greedy(tmp_path, monkeypatch, two_threads):
    from _tiny_models import hf_greedy, load_hf_model

    if cpu_kernel.mkl_packing() is None:
        pytest.skip("torch's MKL has no packed GEMM here")
    monkeypatch.setattr(envs, "STRATA_CPU_PACKED_WEIGHTS", True)
    ckpt = make_tiny_checkpoint("qwen3", tmp_path / "m")
    prompts = [[5 + (7 * i + 3 * j) % 500 for j in range(6 + 5 * i)] for i in range(6)]
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu", block_size=4, num_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(load_hf_model(ckpt), prompts, 12)
    packed = [n for n, p in llm.engine.core.runner.model.named_parameters() if POOL.is_packed(p)]
    assert len(packed) >= 4 * 2, packed  # the decode steps' matmuls of both layers ran on packed weights
