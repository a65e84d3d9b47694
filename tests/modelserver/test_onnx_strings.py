"""ONNX Runtime backend: BYTES (tensor(string)) tensors pass through byte for byte — non-ASCII UTF-8, NULs, and
raw bytes where onnxruntime's Python API can carry them; where it cannot, a 400 names the input."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _model_repos import write_config
from ms_helpers import expect_error, outputs, request, run, serving

KEY = b"\xff\x00\xfe"  # not UTF-8, with a NUL inside


def _save(graph, path) -> None:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _build(repo) -> None:
    """onnx_str: OUT = IN (strings [-1, 2]); onnx_key: IS_KEY = (IN == KEY), a model that reads raw bytes."""
    from onnx import TensorProto, helper

    _save(helper.make_graph(
        [helper.make_node("Identity", ["IN"], ["OUT"])], "s",
        [helper.make_tensor_value_info("IN", TensorProto.STRING, ["b", 2])],
        [helper.make_tensor_value_info("OUT", TensorProto.STRING, ["b", 2])]), repo / "onnx_str" / "1" / "model.onnx")
    write_config(repo / "onnx_str", """
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_STRING dims: [ 2 ] } ]
        output [ { name: "OUT" data_type: TYPE_STRING dims: [ 2 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 20000 }
    """)
    _save(helper.make_graph(
        [helper.make_node("Equal", ["IN", "K"], ["IS_KEY"])], "k",
        [helper.make_tensor_value_info("IN", TensorProto.STRING, ["b", 2])],
        [helper.make_tensor_value_info("IS_KEY", TensorProto.BOOL, ["b", 2])],
        initializer=[helper.make_tensor("K", TensorProto.STRING, [1], [KEY])]), repo / "onnx_key" / "1" / "model.onnx")
    write_config(repo / "onnx_key", """
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_STRING dims: [ 2 ] } ]
        output [ { name: "IS_KEY" data_type: TYPE_BOOL dims: [ 2 ] } ]
        dynamic_batching { max_queue_delay_microseconds: 50000 }
    """)


def _strings(*rows: list[bytes]) -> np.ndarray:
    out = np.empty((len(rows), 2), dtype=object)
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            out[i, j] = v
    return out


ROWS = [[b"abc", b"def"], [b"ab\x00", b"\x00"], ["héllo".encode(), "日本".encode()], [b"", b"a\x00b"]]


def test_utf8_strings_round_trip_exactly_alone_and_batched(tmp_path):
    _build(tmp_path)

    async def main():
        async with serving(tmp_path) as server:
            alone = [outputs(await server.infer(request("onnx_str", IN=_strings(r))))["OUT"] for r in ROWS]
            batched = await asyncio.gather(*(server.infer(request("onnx_str", IN=_strings(r))) for r in ROWS))
            stats = server.statistics("onnx_str")["model_stats"][0]
            return alone, [outputs(b)["OUT"] for b in batched], stats

    alone, batched, stats = run(main())
    assert stats["execution_count"] < 2 * len(ROWS), stats  # the concurrent ones shared executions
    for row, a, b in zip(ROWS, alone, batched):
        for got in (a, b):
            assert got.dtype == object and got.tolist() == [row]
            assert all(type(v) is bytes for v in got.ravel())


def test_raw_bytes_reach_the_model_exactly(tmp_path):
    _build(tmp_path)

    async def main():
        async with serving(tmp_path) as server:
            resp = await server.infer(request("onnx_key", IN=_strings([KEY, b"\xff\x00\xfd"], [b"\xfe\x00\xff", KEY])))
            return outputs(resp)["IS_KEY"]

    assert run(main()).tolist() == [[True, False], [False, True]]


def test_a_batch_mixing_raw_and_text_strings_still_answers_each_request(tmp_path):
    """Batched together, raw bytes and strings of other lengths cannot go in one onnxruntime tensor; each request
    then runs alone and gets its own correct answer."""
    _build(tmp_path)

    async def main():
        async with serving(tmp_path) as server:
            got = await asyncio.gather(server.infer(request("onnx_key", IN=_strings([KEY, b"\xff\xff\xff"]))),
                                       server.infer(request("onnx_key", IN=_strings([b"a", "日本".encode()]))))
            assert server.statistics("onnx_key")["model_stats"][0]["execution_count"] == 2  # batched, then alone
            return [outputs(r)["IS_KEY"].tolist() for r in got]

    assert run(main()) == [[[True, False]], [[False, False]]]


@pytest.mark.parametrize("model, rows, fragments", [
    ("onnx_key", ([b"\xff", b"abc"],), ["input 'IN'", "not UTF-8", "same length"]),
    ("onnx_str", ([b"\xff\xfe", b"\xfe\xff"],), ["input(s) ['IN']", "not UTF-8", "string output"]),
], ids=["ragged-raw-bytes", "raw-bytes-echoed"])
def test_bytes_onnxruntime_cannot_carry_get_a_400_naming_the_input(tmp_path, model, rows, fragments):
    _build(tmp_path)

    async def main():
        async with serving(tmp_path) as server:
            await expect_error("invalid_argument", server.infer(request(model, IN=_strings(*rows))), *fragments)
            # the server keeps serving the same model
            return outputs(await server.infer(request("onnx_str", IN=_strings([b"ok", b"\x00"]))))["OUT"]

    assert run(main()).tolist() == [[b"ok", b"\x00"]]
