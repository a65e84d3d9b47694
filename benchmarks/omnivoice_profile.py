"""Where an OmniVoice batch's GPU time goes: torch.profiler over one eager ``NARRunner.generate`` (kernels by
total CUDA time), released shape with random weights (``omnivoice_bench.build_checkpoint``), batch BS, STEPS steps.
Prints the graph runner's step time for the same batch first, then the kernel table; writes the table to
$OUT/omnivoice_profile.txt.

    BS=32 STEPS=8 python benchmarks/omnivoice_profile.py
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import omnivoice_bench as ob  # noqa: E402

from strataserve.models.omnivoice.loader import load_omnivoice  # noqa: E402
from strataserve.runner.nar_runner import NARRunner  # noqa: E402

BS = int(os.environ.get("BS", 32))


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        folder, _ = ob.build_checkpoint(Path(d) / "omnivoice")
        ov = load_omnivoice(folder, device="cuda", dtype="bfloat16")
        graphs = NARRunner(ov.model, num_codebooks=8, mask_id=ov.config.audio_mask_id, cuda_graphs=True)
        ob.ours_generate(ov, graphs, BS, False)
        gen, _ = ob.ours_generate(ov, graphs, BS, False)
        print(f"graphs: batch {BS}, {ob.STEPS} steps: {gen * 1e3 / ob.STEPS:.2f} ms per step")
        eager = NARRunner(ov.model, num_codebooks=8, mask_id=ov.config.audio_mask_id, cuda_graphs=False)
        ob.ours_generate(ov, eager, BS, False)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            gen, _ = ob.ours_generate(ov, eager, BS, False)
        print(f"eager: {gen * 1e3 / ob.STEPS:.2f} ms per step (under the profiler)")
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
        print(table)
        Path(os.environ.get("OUT", "."), "omnivoice_profile.txt").write_text(table)


if __name__ == "__main__":
    main()
