"""``strata serve`` prints where its start-up time went: the engine process's phases (spawned before the API
process's heavy imports) and when HTTP was ready, all on the clock of the API process's start."""
from __future__ import annotations

import re


def test_serve_prints_its_startup_breakdown(server):
    log = server.log.read_text(errors="replace")
    imports = re.search(r"start-up: API process imports (\d+\.\d+) s \(beside the engine process\)", log)
    engine = re.search(r"engine process: spawned at (\d+\.\d+) s, ready at (\d+\.\d+) s \((.*?)\); "
                       r"tokenizer (\d+\.\d+) s beside it", log, re.S)
    ready = re.search(r"start-up: HTTP ready (\d+\.\d+) s after the process started", log)
    assert imports and engine and ready, log[-3000:]
    spawned, engine_ready, http_ready = float(engine[1]), float(engine[2]), float(ready[1])
    assert spawned < float(imports[1]) <= http_ready  # the engine started before the heavy imports were done
    assert spawned < engine_ready <= http_ready
    phases = dict((m[0], float(m[1])) for m in re.findall(r"([A-Za-z][\w ]*?) (\d+\.\d+) s", engine[3]))
    # phases under 5 ms are left out of the line (a tiny model's weights can load that fast)
    assert {"process spawn", "imports"} <= set(phases) <= ENGINE_PHASES, engine[3]


ENGINE_PHASES = {"process spawn", "imports", "CUDA init", "weights", "KV sizing", "KV allocation", "KV scales",
                 "GEMV tuning", "CUDA graphs", "engine core"}


def test_engine_core_times_each_start_up_phase(tmp_path):
    from strataserve.cli import build_parser, engine_config
    from strataserve.engine.core_proc import build_core
    from strataserve.startup import Phases

    from _tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama3", tmp_path, tokenizer=False)
    args = build_parser().parse_args(["serve", "--device", "cpu", "--num-gpu-blocks-override", "8"])
    phases = Phases()
    core = build_core(engine_config(args, str(path)), phases=phases)
    try:
        names = [name for name, _ in phases.items]
    finally:
        core.shutdown()
    assert names[0] == "imports" and names[-1] == "engine core", names
    assert {"weights", "KV sizing", "KV allocation"} <= set(names) <= ENGINE_PHASES, names
    assert all(sec >= 0 for _, sec in phases.items)


def test_ready_info_reports_the_step_pacing_in_effect(tmp_path):
    """The start-up banner says whether steps are paced: the engine reports the step budget's target (0 when
    unpaced, as on the CPU, where `strata serve`'s automatic target stays off)."""
    from strataserve.cli import build_parser, engine_config
    from strataserve.engine.core_proc import build_core, core_ready_info

    from _tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama3", tmp_path, tokenizer=False)
    for flags, want in (([], 0.0), (["--target-step-ms", "12.5"], 12.5)):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--num-gpu-blocks-override", "8", *flags])
        config = engine_config(args, str(path))
        core = build_core(config)
        try:
            assert core_ready_info(core, config).step_target_ms == want
        finally:
            core.shutdown()


def test_kv_cache_line_reports_the_quantised_capacity():
    from strataserve.router.launch import kv_cache_line
    from strataserve.engine.core_proc import ReadyInfo

    info = ReadyInfo(num_blocks=100, block_size=16, max_model_len=64, kv_cache_bytes=2**30, device="cuda",
                     dtype="bfloat16", kv_cache_dtype="float8_e4m3fn")
    assert kv_cache_line(info) == ("KV cache: 100 blocks × 16 tokens = 1600 tokens, 1.000 GiB in float8_e4m3fn "
                                   "(per-head scales; 2× the blocks of a bfloat16 cache)")
    info.dtype, info.kv_cache_dtype = "float32", "int8"
    assert "4× the blocks of a float32 cache" in kv_cache_line(info)
    info.kv_cache_dtype = ""
    assert kv_cache_line(info).endswith("1.000 GiB")


def test_serve_does_not_import_the_bench_client_before_it_spawns_the_engine():
    """``strata serve`` builds its parser without ``strata bench``'s options, whose module imports aiohttp and
    numpy (~0.3 s before the engine process could start); ``strata bench`` and ``--help`` still get them."""
    import subprocess
    import sys

    code = ("import sys; from strataserve import cli; cli.build_parser({argv}); "
            "print('strataserve.bench.serve' in sys.modules)")
    for argv, loaded in ((["serve", "--port", "1"], False), (["bench", "serve"], True), (["--help"], True)):
        out = subprocess.run([sys.executable, "-c", code.format(argv=argv)], capture_output=True, text=True,
                             timeout=60)
        assert out.stdout.strip().splitlines()[-1:] == [str(loaded)], (argv, out.stdout[-500:], out.stderr[-500:])
