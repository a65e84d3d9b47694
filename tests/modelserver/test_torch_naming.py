"""PyTorch backend: config tensors bind to forward() and to the returned tuple by Triton's naming conventions
(`<name>__<index>`, forward() argument names), whatever order config.pbtxt lists them in."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from ms_helpers import expect_error, outputs, request, run, serving

A = np.array([[1.5, 2.5], [-4.0, 1.0]], np.float32)
B = np.array([[3, 5], [2, 7]], np.int64)
PROD, POS = A * B.astype(np.float32), A.sum(-1, keepdims=True) > 0
OUTS = [("PROD__0", "TYPE_FP32", [-1]), ("POS__1", "TYPE_BOOL", [1])]


def _write_model(repo):
    """TorchScript forward(a: FP32, b: INT64) -> (a * b, a.sum(-1, keepdim=True) > 0): distinct dtypes and outputs,
    so a swapped binding cannot go unnoticed."""
    import torch

    class Two(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor):
            return a * b.to(a.dtype), a.sum(-1, keepdim=True) > 0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.script(Two())
    (repo / "two" / "1").mkdir(parents=True)
    module.save(str(repo / "two" / "1" / "model.pt"))
    (repo / "two" / "config.pbtxt").write_text('name: "two"\nbackend: "pytorch"\n')


def _config(inputs, outs=OUTS) -> str:
    return json.dumps({"name": "two", "backend": "pytorch", "max_batch_size": 4,
                       "input": [{"name": n, "data_type": t, "dims": [-1]} for n, t in inputs],
                       "output": [{"name": n, "data_type": t, "dims": d} for n, t, d in outs]})


@pytest.mark.parametrize("inputs, outs, a_name, b_name", [
    ([("A__0", "TYPE_FP32"), ("B__1", "TYPE_INT64")], OUTS, "A__0", "B__1"),
    ([("B__1", "TYPE_INT64"), ("A__0", "TYPE_FP32")], OUTS, "A__0", "B__1"),  # <name>__<index>, listed swapped
    ([("b", "TYPE_INT64"), ("a", "TYPE_FP32")], OUTS, "a", "b"),  # forward() argument names, listed swapped
    ([("b", "TYPE_INT64"), ("A__0", "TYPE_FP32")], OUTS, "A__0", "b"),  # a mix that still names every position
    ([("A__0", "TYPE_FP32"), ("B__1", "TYPE_INT64")], OUTS[::-1], "A__0", "B__1"),  # outputs listed swapped
    ([("first", "TYPE_FP32"), ("second", "TYPE_INT64")], [("prod", "TYPE_FP32", [-1]), ("pos", "TYPE_BOOL", [1])],
     "first", "second"),  # no convention: the config's order, as in Triton
], ids=["in-order", "indices-swapped", "arg-names-swapped", "mixed", "outputs-swapped", "config-order"])
def test_inputs_and_outputs_bind_by_naming_convention(tmp_path, inputs, outs, a_name, b_name):
    _write_model(tmp_path)
    prod_name, pos_name = (outs[0][0], outs[1][0]) if outs[0][1] == "TYPE_FP32" else (outs[1][0], outs[0][0])

    async def main():
        async with serving(tmp_path, control_mode="explicit") as server:
            await server.load("two", {"config": _config(inputs, outs)})
            return outputs(await server.infer(request("two", **{a_name: A, b_name: B})))

    got = run(main())
    np.testing.assert_array_equal(got[prod_name], PROD)
    np.testing.assert_array_equal(got[pos_name], POS)


@pytest.mark.parametrize("inputs, outs, fragments", [
    ([("A__0", "TYPE_FP32"), ("B__0", "TYPE_INT64")], OUTS, ["'A__0' and 'B__0' both name position 0"]),
    ([("x", "TYPE_INT64"), ("A__0", "TYPE_FP32")], OUTS, ["input 'A__0' names position 0 but is listed at position 1"]),
    ([("A__0", "TYPE_FP32"), ("B__1", "TYPE_INT64")], [("POS__1", "TYPE_BOOL", [1]), ("prod", "TYPE_FP32", [-1])],
     ["output 'POS__1' names position 1 but is listed at position 0"]),
    ([("A__0", "TYPE_FP32"), ("B__2", "TYPE_INT64")], OUTS, ["'B__2' names forward() position 2"]),
    ([("a", "TYPE_FP32")], OUTS, ["forward() argument(s) ['b']"]),
    ([("a", "TYPE_FP32"), ("b", "TYPE_INT64"), ("c", "TYPE_INT64")], OUTS, ["declares 3 inputs", "takes 2"]),
], ids=["duplicate-index", "mixed-contradiction", "output-contradiction", "index-out-of-range", "arg-unbound",
        "too-many-inputs"])
def test_unresolvable_names_fail_the_load(tmp_path, inputs, outs, fragments):
    _write_model(tmp_path)

    async def main():
        async with serving(tmp_path, control_mode="explicit") as server:
            await expect_error("invalid_argument", server.load("two", {"config": _config(inputs, outs)}), *fragments)

    run(main())


def test_named_output_index_beyond_the_returned_tuple_is_an_error(tmp_path):
    _write_model(tmp_path)
    outs = [("PROD__0", "TYPE_FP32", [-1]), ("EXTRA__2", "TYPE_FP32", [-1])]

    async def main():
        async with serving(tmp_path, control_mode="explicit") as server:
            await server.load("two", {"config": _config([("a", "TYPE_FP32"), ("b", "TYPE_INT64")], outs)})
            await expect_error("internal", server.infer(request("two", a=A, b=B)), "returned 2 tensors",
                               "'EXTRA__2': 2")

    run(main())
