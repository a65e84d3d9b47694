"""Where a step's GPU time goes: per-kernel device time from ``torch.profiler`` (CUDA activity), summed by kernel
name, for (a) model-level decode steps replayed from CUDA graphs (random weights in real shapes), (b) windows of
engine steps of the nano-vllm throughput workload (prefill-heavy start, then decode at large batch).

    PYTHONPATH=.:benchmarks python benchmarks/gpu_profile.py decode <llama8b|qwen06b> <mode> <batch> <prompt>
    (engine windows are called from gpu_bench.py's "profile-throughput" item)
Writes a text table to stdout (and $OUT/profile_*.txt from gpu_bench).
"""
from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_table(prof, steps: int, title: str, top: int = 25) -> str:
    """Kernel totals (device time) sorted by time: calls, total ms, us per step, share of the summed kernel time."""
    rows = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name if len(evt.name) < 70 else evt.name[:67] + "..."
        n, t = rows.get(name, (0, 0.0))
        rows[name] = (n + 1, t + evt.device_time)  # us
    total = sum(t for _, t in rows.values()) or 1.0
    lines = [f"== {title}: {steps} steps, summed kernel time {total / 1e3:.2f} ms = {total / steps:.1f} us/step",
             f"{'kernel':70s} {'calls':>7s} {'ms':>9s} {'us/step':>9s} {'share':>6s}"]
    for name, (n, t) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{name:70s} {n:7d} {t / 1e3:9.2f} {t / steps:9.1f} {t / total:6.1%}")
    return "\n".join(lines)


def profile_decode(cfg, mode: str, batch: int, prompt: int, steps: int = 10) -> str:
    """Kernel table of ``steps`` decode steps of the model-level benchmark (graph replays in graph modes)."""
    import gpu_model_bench as mb

    s = mb._Setup(cfg, mode, batch, prompt, steps + 8)
    if s.graphs is not None:
        s.graphs.capture()
    s.run(4)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        s.run(steps)
        torch.cuda.synchronize()
    table = kernel_table(prof, steps, f"decode {cfg.architecture} {mode} batch {batch} prompt {prompt}")
    del s
    torch.cuda.empty_cache()
    return table


def profile_engine_windows(eng, prompts, outs, windows: tuple[tuple[int, int], ...]) -> str:
    """Run the workload through ``eng`` step by step, profiling the engine steps in each [start, end) window."""
    from strataserve.types.sampling import SamplingParams

    for i, (p, n) in enumerate(zip(prompts, outs)):
        eng.add_request(f"p{i}", list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    tables, step = [], 0
    while eng.has_unfinished_requests():
        win = next((w for w in windows if w[0] == step), None)
        if win is None:
            eng.step()
            step += 1
            continue
        torch.cuda.synchronize()
        running = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(win[1] - win[0]):
                if not eng.has_unfinished_requests():
                    break
                eng.step()
                running.append(len(eng.core.scheduler.running))
                step += 1
            torch.cuda.synchronize()
        tables.append(kernel_table(prof, max(1, len(running)), f"engine steps {win[0]}-{step} (running {running[:1]}"
                                                              f"..{running[-1:]})"))
    return "\n\n".join(tables)


if __name__ == "__main__":
    import gpu_model_bench as mb
    _, what, model, mode, batch, prompt = sys.argv
    cfg = mb.llama31_8b() if model == "llama8b" else mb.qwen3_06b()
    print(profile_decode(cfg, mode, int(batch), int(prompt)))
