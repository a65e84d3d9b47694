"""A router config entry takes the serve flags the README says it takes: `generation_config` (per entry, else the
command line's `--generation-config`) and vLLM's dtype aliases."""
from __future__ import annotations

from rich.console import Console

from strataserve.assets import DEMO_MODEL_DIR
from strataserve.cli import _serve_options, build_parser


def _options(argv: list[str]):
    return _serve_options(build_parser().parse_args(["serve", *argv]), Console(quiet=True))


def test_generation_config_and_dtype_aliases_per_entry(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"models:\n"
                   f"  - {{name: a, path: {DEMO_MODEL_DIR}, generation_config: vllm, dtype: half}}\n"
                   f"  - {{name: b, path: {DEMO_MODEL_DIR}, dtype: float}}\n")
    a, b = _options(["--config", str(cfg)]).llms
    assert (a.generation_config, b.generation_config) == ("vllm", "auto")
    assert str(a.engine.model.dtype).endswith("float16") and str(b.engine.model.dtype).endswith("float32")
    a, b = _options(["--config", str(cfg), "--generation-config", "vllm"]).llms
    assert (a.generation_config, b.generation_config) == ("vllm", "vllm")  # the flag is every entry's default
