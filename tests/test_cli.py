"""The `strata` command's own surface: --version, and help that states each default once."""
from __future__ import annotations

import re

import pytest

from strataserve import __version__
from strataserve.cli import build_parser


def test_version_flag(capsys):
    for flag in ("--version", "-V"):
        with pytest.raises(SystemExit) as exc:
            build_parser([flag]).parse_args([flag])
        assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"strataserve {__version__}"


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_help_states_each_default_once(command, capsys):
    argv = [command, "serve", "--help"] if command == "bench" else [command, "--help"]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "(default" in text
    assert not re.search(r"\(default[^)]*\) \(default", text), text
