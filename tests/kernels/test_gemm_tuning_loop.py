"""The decode GEMM tunings' shared timing loop (``gemm_tuning._tune_shapes``) on any device: the timer is replaced by
one that runs what it is given (so the baseline and every candidate really launch) and reports fixed times, which
checks what each tuning times against what, and the margin a candidate must win by."""
from __future__ import annotations

import torch

from strataserve.kernels.skinny_gemm import GemmConfig
from strataserve.runner import gemm_tuning

A, B = GemmConfig(16, 16, 32), GemmConfig(16, 32, 32)


def _timer(monkeypatch, times: dict[str, float]):
    """``_graph_seconds`` / ``rank_configs`` stand-ins: run the functions, report ``times`` (per call, so the
    per-layer division gives them back) by what was run."""
    ran = []

    def graph_seconds(fn, reps):
        fn()
        ran.append("baseline")
        return times["baseline"] * 2  # two layers' weights per call

    def rank(make, candidates, reps, n):
        out = []
        for c in candidates:
            make(c)()
            ran.append(str(c))
            out.append((times[str(c)], c))
        return sorted(out, key=lambda tc: tc[0])

    monkeypatch.setattr(gemm_tuning, "_graph_seconds", graph_seconds)
    monkeypatch.setattr(gemm_tuning, "rank_configs", rank)
    return ran


def test_tunings_time_baseline_and_candidates_and_keep_a_margin(device, monkeypatch):
    ws = {(64, 32): [torch.randn(64, 32, device=device) for _ in range(2)]}
    classes = ((16, 4),)
    ran = _timer(monkeypatch, {"baseline": 10e-6, str(A): 9.0e-6, str(B): 9.97e-6})
    plain = gemm_tuning.tune_gemm(ws, (A, B), row_classes=classes)
    assert [(c.kind, c.rows, c.config, round(c.cublas_us, 3), round(c.best_us, 3)) for c in plain] == \
        [("plain", 16, A, 10.0, 9.0)]
    assert ran == ["baseline", str(A), str(B)]
    # the SiLU tuning: its baseline is the plain choice + the activation; 0.3% faster is inside the 0.5% margin
    _timer(monkeypatch, {"baseline": 10e-6, str(A): 9.97e-6})
    silu = gemm_tuning.tune_gate_up_silu(ws, plain, (A,), row_classes=classes)
    assert [(c.kind, c.config, round(c.best_us, 3)) for c in silu] == [("silu", None, 9.97)]
    _timer(monkeypatch, {"baseline": 10e-6, str(A): 9.9e-6})
    assert gemm_tuning.tune_gate_up_silu(ws, plain, (A,), row_classes=classes)[0].config == A
