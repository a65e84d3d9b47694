"""`strata serve --[no-]strict-readiness` reaches the model server's options: on by default (Triton's default),
off when asked, with a repository from the command line or a config file; given without any repository it is
refused at start (exit 2, naming the flag and the missing --model-repository), as the other repository flags."""
from __future__ import annotations

import pytest
from rich.console import Console

from strataserve import cli
from strataserve.cli import _serve_options, build_parser


def _options(argv: list[str]):
    return _serve_options(build_parser().parse_args(["serve", *argv]), Console(stderr=True, width=300))


def test_strict_readiness_is_on_unless_turned_off(tmp_path):
    (tmp_path / "repo").mkdir()
    repo = ["--model-repository", str(tmp_path / "repo")]
    assert _options(repo).strict_readiness is True
    assert _options([*repo, "--strict-readiness"]).strict_readiness is True
    assert _options([*repo, "--no-strict-readiness"]).strict_readiness is False
    cfg = tmp_path / "router.yaml"
    cfg.write_text(f"model_repository: {tmp_path / 'repo'}\n")
    assert _options(["--config", str(cfg), "--no-strict-readiness"]).strict_readiness is False


@pytest.mark.parametrize("flag", ["--strict-readiness", "--no-strict-readiness"])
def test_strict_readiness_without_a_repository_is_refused(flag, capsys):
    assert _options([flag]) is None
    err = capsys.readouterr().err
    assert f"{flag} applies to repository models: give --model-repository too" in err
    assert cli.main(["serve", flag, "--grpc-port", "0"]) == 2
