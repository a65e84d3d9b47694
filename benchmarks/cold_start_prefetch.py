"""`strata serve` from a cold page cache, with and without the engine's weight prefetch (``models/prefetch.py``,
``STRATA_WEIGHT_PREFETCH``), rounds alternating which goes first.

Writes a random float32 Llama-shaped checkpoint of about 3.4 GB (2048 hidden, 16 layers; HF's own classes, so the
folder is an ordinary HF checkpoint) unless ``--model`` already holds one, then before every start syncs and drops
the OS page cache (root only: ``/proc/sys/vm/drop_caches``), so each start reads the weights from the disk. One
JSON line per start (ready time and the engine's phases, parsed as ``serve_startup.py`` does) to stdout and
$OUT/cold_start_prefetch.jsonl.

    python benchmarks/cold_start_prefetch.py [--model /tmp/cold1b] [--rounds 3] [-- extra serve args]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from serve_startup import start_once  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))


def write_checkpoint(path: Path) -> None:
    from _tiny_checkpoint import write_word_tokenizer
    from _tiny_models import make_tiny_checkpoint

    make_tiny_checkpoint("llama3", path, tokenizer=False, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                         vocab_size=32000, max_shard_size="2GB")
    write_word_tokenizer(path, 32000)


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/cold1b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="extra `strata serve` arguments (after --)")
    args = ap.parse_args()
    model = Path(args.model)
    if not (model / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(model)
        print(json.dumps({"bench": "write_checkpoint", "seconds": round(time.perf_counter() - t0, 1),
                          "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors"))}), flush=True)
    extra = args.extra or ["--device", "cpu", "--max-model-len", "1024"]
    for r in range(1, args.rounds + 1):
        for value in (("1", "0") if r % 2 else ("0", "1")):
            drop_caches()
            row = {"bench": "cold_start_prefetch", "round": r, "STRATA_WEIGHT_PREFETCH": value, "args": extra}
            try:
                row.update(start_once(HERE.parent, str(model), extra, OUT / f"cold_{value}_{r}.log",
                                      env_extra={"STRATA_WEIGHT_PREFETCH": value}))
            except Exception as exc:  # one failed start must not lose the others
                row["error"] = repr(exc)[:600]
            line = json.dumps(row)
            print(line, flush=True)
            with (OUT / "cold_start_prefetch.jsonl").open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
