"""Units of the door: per-key token buckets (a fake clock), the API-key check, the queued-bytes budget, drain,
request limits, and the rule that nothing in the package unpickles data it did not produce itself."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from strataserve.api.door import Door, DoorConfig
from strataserve.api.errors import APIError
from strataserve.api.limits import RequestLimits
from strataserve.router.quota import KeyQuota, RateLimits

PACKAGE = Path(__file__).resolve().parents[2] / "strataserve"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_requests_per_minute_are_per_key_and_refill():
    clock = Clock()
    quota = KeyQuota(RateLimits(requests_per_minute=3), clock)
    for _ in range(3):
        quota.take_request("a")
    with pytest.raises(APIError) as err:
        quota.take_request("a")
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "20"  # one request per 20 s
    quota.take_request("b")  # another key has its own allowance
    clock.t += 20
    quota.take_request("a")
    with pytest.raises(APIError):
        quota.take_request("a")


def test_tokens_per_minute_charge_the_estimate():
    clock = Clock()
    quota = KeyQuota(RateLimits(tokens_per_minute=600), clock)
    quota.take_tokens("k", 500)
    with pytest.raises(APIError) as err:
        quota.take_tokens("k", 200)
    assert err.value.status == 429 and err.value.code == "tokens_per_minute_exceeded"
    assert err.value.headers["Retry-After"] == "10"  # 100 tokens short at 10 tokens/s
    with pytest.raises(APIError) as err:
        quota.take_tokens("k", 601)  # could never fit in a minute
    assert err.value.status == 400 and "lower max_tokens" in err.value.message
    with pytest.raises(ValueError):
        RateLimits(tokens_per_minute=0)


def test_api_keys_queued_bytes_and_drain():
    door = Door(DoorConfig(api_keys=("k1", "k2"), max_queued_bytes=100))
    door.authorize(b"Bearer k2")
    for bad in (None, b"", b"Bearer k3", b"k1", b"Bearer k1 "):
        with pytest.raises(APIError) as err:
            door.authorize(bad)
        assert err.value.status == 401
    assert "/metrics" in door.open_paths
    assert "/metrics" not in Door(DoorConfig(metrics_require_key=True)).open_paths
    door.admit(None, 60)
    door.enter(60)
    with pytest.raises(APIError) as err:
        door.admit(None, 41)
    assert err.value.status == 503 and "100" in err.value.message

    async def drain() -> tuple[bool, bool]:
        door.begin_drain()
        with pytest.raises(APIError) as err:
            door.admit(None, 0)
        assert err.value.status == 503 and err.value.headers["Retry-After"]
        timed_out = await door.wait_idle(0.05)
        asyncio.get_running_loop().call_later(0.05, door.leave, 60)
        return timed_out, await door.wait_idle(5)

    assert asyncio.run(drain()) == (False, True)


def _body(**kw):
    base = dict(n=1, max_tokens=8, max_completion_tokens=None, stop=None, logit_bias=None)
    return SimpleNamespace(**{**base, **kw})


def test_request_limits():
    limits = RequestLimits(max_n=2, max_tokens=10, max_prompt_tokens=5, max_stop=1, max_stop_chars=3,
                           max_logit_bias=1)
    limits.check(_body(max_tokens=10, stop="abc"))
    for kw, param in ((dict(n=3), "n"), (dict(max_tokens=11), "max_tokens"),
                      (dict(max_completion_tokens=11), "max_completion_tokens"), (dict(stop=["a", "b"]), "stop"),
                      (dict(stop="abcd"), "stop"), (dict(logit_bias={"1": 1, "2": 2}), "logit_bias")):
        with pytest.raises(APIError) as err:
            limits.check(_body(**kw))
        assert err.value.status == 400 and err.value.param == param
    limits.check_prompt(5)
    with pytest.raises(APIError):
        limits.check_prompt(6)
    with pytest.raises(ValueError):
        RequestLimits(max_n=0)


def test_nothing_unpickles_untrusted_data():
    """Requests are decoded by msgspec / numpy.frombuffer / protobuf. The only pickles travel between a process and
    the children it spawned itself: the isolated Python model's pipe, and a tensor-parallel engine's job (stdin) and
    per-step broadcast (its own process group, rendezvous on 127.0.0.1). ``torch.load`` only with
    ``weights_only=True`` (tensors and plain containers, no code)."""
    risky = re.compile(r"\bpickle\b|\bdill\b|\bjoblib\b|\bshelve\b|\bmarshal\.loads|allow_pickle\s*=\s*True|"
                       r"torch\.load\((?!.*weights_only=True)|yaml\.load\(|yaml\.unsafe_load|"
                       r"(?<![.\w])(?<!def )(eval|exec)\(")
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if risky.search(line):
                found.append(f"{path.relative_to(PACKAGE)}:{i}")
    allowed = {"modelserver/backends/python_isolated.py", "runner/tp_worker.py"}
    assert {f.split(":")[0] for f in found} <= allowed, found


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_api_key_is_refused_not_open(value, capsys, monkeypatch):
    """``--api-key "$KEY"`` with KEY unset would serve everyone without a key: refused at start-up, as is an empty
    key in the config's api_keys (given or read from its variable)."""
    from strataserve.cli import build_parser
    from strataserve.router.config import RouterConfig

    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(["serve", "--api-key", value])
    assert err.value.code == 2 and "--api-key" in capsys.readouterr().err
    monkeypatch.setenv("EMPTY_KEY", value)
    for entry in ({"key": value, "sla": "default"}, {"key_env": "EMPTY_KEY", "sla": "default"}):
        with pytest.raises(ValueError, match="empty"):
            RouterConfig.model_validate({"api_keys": [entry]})


@pytest.mark.parametrize("flag,value", [("--max-request-body-mib", "0"), ("--max-request-body-mib", "-1"),
                                        ("--max-queued-mib", "0"), ("--grpc-max-message-mib", "nan"),
                                        ("--shutdown-timeout", "-1")])
def test_bad_limit_flags_name_themselves(flag, value, capsys):
    from strataserve.cli import build_parser

    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(["serve", flag, value])
    assert err.value.code == 2 and flag in capsys.readouterr().err


def test_bearer_scheme_is_case_free_but_the_key_is_not():
    door = Door(DoorConfig(api_keys=("Secret",)))
    for header in ("Bearer Secret", "bearer Secret", "BEARER Secret"):
        door.authorize(header)
    for header in ("Bearer secret", "Basic Secret", "Secret"):
        with pytest.raises(APIError):
            door.authorize(header)


def test_vllm_dtype_names_and_load_model_without_a_repository(capsys):
    from rich.console import Console

    from strataserve.cli import _serve_options, build_parser
    from strataserve.config import ModelConfig

    assert ModelConfig(model="m", dtype="half").dtype == "float16"
    assert ModelConfig(model="m", dtype="float").dtype == "float32"
    args = build_parser().parse_args(["serve", "--load-model", "x"])
    assert _serve_options(args, Console(file=None, stderr=True, width=200)) is None
    assert "--model-repository" in capsys.readouterr().err
