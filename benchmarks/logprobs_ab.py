"""The sampler's token logprobs on the GPU: ``STRATA_LOGPROBS=torch`` (log_softmax + gather + rank count + topk over a
full copy) against ``kernel`` (one read of each row, ``kernels/token_logprobs.py``, the top n included),
both through ``runner/sampler.py: token_logprobs_deferred`` (its ``path`` argument, which the env var sets).

Cases: rows 1, 16, 64, 256 at the Qwen3 vocabulary (151,936), float32 logits ``torch.randn * 4`` (fixed seed),
chosen = the argmax, logprobs n = 1, 5 and 20 on every row. Each path is timed with ``triton.testing.do_bench`` (median,
after its warm-up), three rounds with the order alternating; the reported time is the median over rounds. The
paths' results are compared: the largest |difference| of the chosen and top-n log-probs, and how many ranks agree.

    python benchmarks/logprobs_ab.py [--rounds 3]     # CUDA only: one JSON line per (rows, n)
    python benchmarks/logprobs_ab.py --cpu-check      # no GPU: the kernel under TRITON_INTERPRET=1, small V
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = (1, 16, 64, 256)
NS = (1, 5, 20)  # (20: MAX_LOGPROBS, the largest top-n a request may ask)
VOCAB = 151_936


def compare(got, want) -> dict:
    """Largest |Δ log-prob| (chosen and top-n) and rank / top-id agreement of two ``DeferredLogprobs``."""
    import torch

    d = (got.chosen_lp.float() - want.chosen_lp.float()).abs().max().item()
    if got.top_lps is not None:
        d = max(d, (got.top_lps.float() - want.top_lps.float()).abs().max().item())
    same_ids = got.top_ids is None or torch.equal(got.top_ids, want.top_ids)
    return {"max_abs_diff": d, "rank_equal": int((got.ranks == want.ranks).sum().item()), "top_ids_equal": same_ids}


def gpu_bench(rounds: int) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("logprobs_ab.py: needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "run with --cpu-check for the interpreter check without one")
    import triton
    from triton.testing import do_bench

    from strataserve.runner.sampler import token_logprobs_deferred

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in ROWS:
        x = torch.randn(rows, VOCAB, generator=g, device="cuda") * 4
        tokens = x.argmax(dim=-1)
        for n in NS:
            top_ns = [n] * rows
            fns = {p: (lambda p=p: token_logprobs_deferred(x, tokens, top_ns, path=p)) for p in ("torch", "kernel")}
            times: dict[str, list[float]] = {"torch": [], "kernel": []}
            for rnd in range(rounds):
                for p in (("torch", "kernel") if rnd % 2 == 0 else ("kernel", "torch")):
                    times[p].append(do_bench(fns[p], warmup=25, rep=100, return_mode="median"))
            t_ms, k_ms = statistics.median(times["torch"]), statistics.median(times["kernel"])
            agree = compare(fns["kernel"](), fns["torch"]())
            print(json.dumps({"bench": "logprobs_ab", "rows": rows, "n": n, "vocab": VOCAB,
                              "torch_ms": round(t_ms, 4), "kernel_ms": round(k_ms, 4),
                              "speedup": round(t_ms / k_ms, 3), **agree, "rounds": rounds, **meta}), flush=True)


def cpu_check() -> int:
    """The kernel path under Triton's interpreter against the torch path on CPU tensors: returns the failures."""
    import torch

    from strataserve.runner.sampler import token_logprobs_deferred

    g = torch.Generator().manual_seed(0)
    bad = 0
    for rows, vocab in ((1, 5003), (16, 5003), (4, 1000)):
        x = torch.randn(rows, vocab, generator=g) * 4
        for pick in ("argmax", "random"):
            tokens = x.argmax(dim=-1) if pick == "argmax" else torch.randint(0, vocab, (rows,), generator=g)
            for n in NS:
                got = token_logprobs_deferred(x, tokens, [n] * rows, path="kernel")
                want = token_logprobs_deferred(x, tokens, [n] * rows, path="torch")
                agree = compare(got, want)
                ok = agree["max_abs_diff"] <= 1e-5 and agree["rank_equal"] == rows and agree["top_ids_equal"]
                bad += not ok
                print(json.dumps({"bench": "logprobs_ab", "mode": "cpu-check", "rows": rows, "vocab": vocab,
                                  "chosen": pick, "n": n, **agree, "ok": ok}), flush=True)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-check", action="store_true", help="run the kernel under TRITON_INTERPRET=1 on CPU")
    args = ap.parse_args()
    if args.cpu_check:
        import warnings

        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy on -inf - -inf, log2(0): handled in the kernel
        failures = cpu_check()
        sys.exit(f"logprobs_ab.py --cpu-check: {failures} case(s) disagree" if failures else 0)
    gpu_bench(args.rounds)


if __name__ == "__main__":
    main()
