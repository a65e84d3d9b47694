"""Router pieces on their own: replica choice, admission, cost sharing, SLA resolution, the KServe client codec."""
from __future__ import annotations

import time

import numpy as np
import pytest

from strataserve.api.errors import APIError
from strataserve.api.kserve_codec import decode_http_request, encode_http_response
from strataserve.types.tensors import InferRequest, InferResponse, InferTensor
from strataserve.router.admission import MIN_SAMPLES, AdmissionController
from strataserve.router.cost import CostMeter
from strataserve.router.kserve_client import HEADER_LENGTH, decode_response, encode_request
from strataserve.router.replicas import ReplicaSet
from strataserve.router.sla import SLA, SLAPolicy

URLS = [f"http://127.0.0.{i + 2}:8000" for i in range(4)]  # never contacted


def test_least_outstanding_wins_without_a_prefix():
    rs = ReplicaSet("m", URLS)
    for r, n in zip(rs.replicas, (3, 1, 2, 5)):
        r.outstanding = n
    assert rs.choose(None).url == URLS[1]
    rs.replicas[1].mark_down("boom")
    assert rs.choose(None).url == URLS[2]
    assert rs.choose(None, exclude=(rs.replicas[2],)).url == URLS[0]


def test_prefix_affinity_is_stable_and_yields_to_load():
    rs = ReplicaSet("m", URLS, affinity_chars=256, slack=2)
    prefixes = [f"system prompt number {i} " * 8 for i in range(40)]
    first = {p: rs.choose(p).url for p in prefixes}
    assert {p: rs.choose(p).url for p in prefixes} == first  # same prefix, same replica
    assert len(set(first.values())) >= 3  # and prefixes spread over the replicas
    p = prefixes[0]
    affine = next(r for r in rs.replicas if r.url == first[p])
    affine.outstanding = 3  # 3 <= 1 + slack 2: the affine replica still wins
    for r in rs.replicas:
        if r is not affine:
            r.outstanding = 1
    assert rs.choose(p) is affine
    affine.outstanding = 4  # 4 > 1 + 2: load wins
    assert rs.choose(p) is not affine
    # removing one replica only moves the prefixes that were on it (rendezvous hashing)
    gone = rs.replicas[3]
    gone.mark_down("x")
    for r in rs.replicas:
        r.outstanding = 0
    moved = [q for q in prefixes if first[q] != gone.url and rs.choose(q).url != first[q]]
    assert moved == []
    assert rs.choose("short") is not None  # too short for affinity: least loaded


def test_all_down_message_names_model_and_errors():
    rs = ReplicaSet("big", URLS[:2])
    for r in rs.replicas:
        r.mark_down("connection refused")
    assert rs.choose("anything " * 20) is None
    msg = rs.unavailable_message()
    assert "`big`" in msg and "all 2 upstream replicas" in msg and "connection refused" in msg


def test_admission_learns_the_pace_then_refuses_what_cannot_meet_the_target():
    ctl = AdmissionController("m")
    # an idle server takes anything, even with an impossible target
    t = ctl.admit(0, 100, ttft_ms=0.001)
    ctl.first_token(t)
    tickets = []
    for _ in range(MIN_SAMPLES):
        tickets.append(ctl.admit(0, 100, None))
    time.sleep(0.02)
    for t in tickets:
        ctl.first_token(t)  # samples: ~20 ms over up to 400 tokens of work
    assert ctl.seconds_per_work is not None and ctl.samples >= MIN_SAMPLES
    ahead = ctl.admit(0, 1000, None)  # queued work of the same class
    with pytest.raises(APIError) as exc:
        ctl.admit(0, 100, ttft_ms=0.01)
    assert exc.value.status == 429 and int(exc.value.headers["Retry-After"]) >= 1
    # a lower class's queue does not count against a higher class
    low = AdmissionController("m2")
    low.seconds_per_work, low.samples = 1.0, MIN_SAMPLES
    low.admit(10, 1000, None)
    low.admit(0, 10, ttft_ms=1.0)  # nothing of priority <= 0 ahead: admitted
    ctl.release(ahead)
    ctl.release(ahead)  # safe twice
    assert ctl.work_ahead(100) == 0


def test_admission_counts_the_slots_running_requests_hold():
    """Two long decodes hold both slots: a third request waits for one to finish, which its TTFT target cannot
    afford (the prefill queue alone is empty). A free slot, a lower class holding them, or a decode about to end
    admit it."""
    ctl = AdmissionController("m", slots=2)
    running = [ctl.admit(0, 10, None, seqs=1, budget=500) for _ in range(2)]
    for t in running:
        ctl.first_token(t)
        for _ in range(MIN_SAMPLES):
            ctl.on_tokens(t, 1, 0.01)  # 10 ms a token
    assert ctl.slot_wait_s(0) == pytest.approx((500 - MIN_SAMPLES) * 0.01, rel=0.05)
    with pytest.raises(APIError) as exc:
        ctl.check(0, 10, ttft_ms=200)
    assert exc.value.status == 429 and int(exc.value.headers["Retry-After"]) >= 4
    ctl.check(0, 10, ttft_ms=10_000)  # a looser class can wait for the slot
    ctl.release(running[0])
    ctl.check(0, 10, ttft_ms=200)  # a slot is free again
    assert ctl.slot_wait_s(0, seqs=2) == pytest.approx((500 - MIN_SAMPLES) * 0.01, rel=0.05)  # n=2 needs both
    ending = ctl.admit(0, 10, None, budget=5)
    ctl.first_token(ending)
    ctl.on_tokens(ending, 4, 0.01)
    ctl.check(0, 10, ttft_ms=200)  # both held, but one has a token left: ~10 ms
    low = AdmissionController("low", slots=1)
    t = low.admit(10, 10, None, budget=1000)
    low.first_token(t)
    for _ in range(MIN_SAMPLES):
        low.on_tokens(t, 1, 0.01)
    low.check(0, 10, ttft_ms=50)  # a higher class preempts the lower one's slot
    with pytest.raises(APIError):
        low.check(10, 10, ttft_ms=50)


def test_cost_is_shared_by_concurrent_requests():
    meter = CostMeter(gpu_cost_per_hour=3600.0)  # 1 per GPU-second
    a = meter.enter()
    time.sleep(0.05)
    b = meter.enter()
    time.sleep(0.05)
    share_a = meter.leave(a)
    time.sleep(0.05)
    share_b = meter.leave(b)
    # a: 0.05 alone + 0.05 shared; b: 0.05 shared + 0.05 alone -> both about 0.075 GPU-seconds
    assert share_a == pytest.approx(0.075, abs=0.02) and share_b == pytest.approx(0.075, abs=0.02)
    assert meter.cost_per_1k(share_a, 10) == pytest.approx(share_a * 100)
    assert CostMeter(None).cost_per_1k(1.0, 10) is None and meter.cost_per_1k(1.0, 0) is None


def test_sla_resolution():
    pol = SLAPolicy({"hi": SLA("hi", 0, 100.0), "lo": SLA("lo", 10)}, "hi", {"k-lo": "lo"})
    assert pol.resolve(None, None).name == "hi"
    assert pol.resolve("lo", None).name == "lo"
    assert pol.resolve(None, "k-lo").name == "lo"
    assert pol.resolve("lo", "k-lo").name == "lo"
    with pytest.raises(APIError) as e:
        pol.resolve("hi", "k-lo")
    assert e.value.status == 403
    with pytest.raises(APIError) as e:
        pol.resolve("gold", None)
    assert e.value.status == 400 and "hi, lo" in e.value.message


def test_kserve_client_codec_round_trips_through_the_server_codec():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    words = np.array([b"a", b"\xff\x00bytes"], dtype=object)
    req = InferRequest("m", "2", "id-1", [InferTensor("X", "FP32", [3, 4], x), InferTensor("W", "BYTES", [2], words)],
                       requested_outputs=["Y"], parameters={"p": 1}, priority=2, timeout_us=500)
    body, hlen = encode_request(req)
    back = decode_http_request(body, str(hlen), "m", "2")
    got = back.request
    assert got.id == "id-1" and got.priority == 2 and got.timeout_us == 500 and got.parameters == {"p": 1}
    np.testing.assert_array_equal(got.inputs[0].data, x)
    assert list(got.inputs[1].data) == list(words) and back.binary_outputs == {"Y": True}
    resp = InferResponse("upstream-name", "2", "id-1", [InferTensor("Y", "INT64", [2], np.array([5, -6]))])
    out, out_hlen = encode_http_response(resp, back)
    dec = decode_response(out, str(out_hlen), "local-name")
    assert dec.model_name == "local-name" and dec.model_version == "2" and dec.id == "id-1"
    np.testing.assert_array_equal(dec.outputs[0].data, [5, -6])
    assert HEADER_LENGTH == "Inference-Header-Content-Length"
