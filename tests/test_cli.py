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


def test_interrupted_start_up_exits_as_the_signal_says(monkeypatch):
    """Stopped while loading: SIGTERM exits 143 (128 + 15), Ctrl-C 130, as a shell reports a killed process."""
    import os
    import signal
    import time

    from strataserve import cli

    def load_then(sig):
        def func(args):
            os.kill(os.getpid(), sig)  # arrives while "loading"
            time.sleep(10)  # the handler's exception ends the sleep
            raise AssertionError("the signal's handler never ran")
        return func

    import argparse

    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        parsed = argparse.Namespace(func=load_then(sig))
        monkeypatch.setattr(cli, "build_parser", lambda argv, a=parsed: argparse.Namespace(parse_args=lambda _: a))
        previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        # Ctrl-C as a `strata` started from a terminal has it: a test run started as a background command of a
        # non-interactive shell (`sh -c 'make test &'`) inherits SIGINT ignored, which Python keeps, and CI then
        # got "not reached"
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            assert cli.main(["generate"]) == code
        finally:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])
