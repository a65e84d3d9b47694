"""Triton's vLLM-backend text I/O (modelserver/llm_io.py), shared by repository LLMs and the router's text models:
tensors and parameters read, string values typed, refusals naming the parameter, responses shaped."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from strataserve.modelserver.llm_io import TextResponder, parse_text_request, sampling_params, text_model_spec
from strataserve.types.tensors import InferRequest, ModelServerError


def _text(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=object)


def test_tensors_parameters_and_sampling_parameters():
    inputs = {"text_input": _text("hi"), "stream": np.array([True]),
              "sampling_parameters": _text(json.dumps({"temperature": "0.5", "max_tokens": "7", "ignore_eos": "true",
                                                       "top_k": 3})),
              "return_num_output_tokens": np.array([True])}
    req = parse_text_request(inputs, {"temperature": 0.1, "seed": 4, "exclude_input_in_output": False}, "m")
    assert req.prompt == "hi" and req.stream is True and not req.exclude_input
    assert req.returns == {"num_output_tokens"}
    p = sampling_params(req.parameters, "m", defaults={"top_p": 0.9, "temperature": 1.0})
    assert (p.temperature, p.max_tokens, p.ignore_eos, p.top_k, p.seed, p.top_p) == (0.5, 7, True, 3, 4, 0.9)
    plain = parse_text_request({"text_input": _text("hi")}, {}, "m")
    assert plain.stream is None and plain.exclude_input and plain.returns == frozenset()


@pytest.mark.parametrize("params, named", [
    ({"bogus": 1}, "bogus"), ({"top_p": "x"}, "top_p"), ({"temperature": -2}, "temperature"),
    ({"output_kind": "final_only"}, "output_kind"), ({"n": 3}, "'n'"), ({"ignore_eos": "maybe"}, "ignore_eos"),
])
def test_refusals_name_the_parameter(params, named):
    with pytest.raises(ModelServerError) as e:
        sampling_params(params, "m")
    assert e.value.code == "invalid_argument" and named in e.value.message


def test_bad_sampling_parameters_tensor():
    for raw, says in (("{nope", "not JSON"), ("[1]", "JSON object")):
        with pytest.raises(ModelServerError, match=says):
            parse_text_request({"text_input": _text("hi"), "sampling_parameters": _text(raw)}, {}, "m")
    with pytest.raises(ModelServerError, match="stream"):
        parse_text_request({"text_input": _text("hi")}, {"stream": "sometimes"}, "m")


@dataclass
class _Completion:
    text: str
    token_ids: list
    finish_reason: str | None = None
    stop_reason: object = None


@dataclass
class _Out:
    outputs: list
    finished: bool = False
    prompt_token_ids: list = field(default_factory=lambda: [1, 2, 3])


def test_responder_pieces_whole_and_prompt():
    spec = text_model_spec("m")
    outs = [_Out([_Completion("ab", [5])]), _Out([_Completion("", [6])]),
            _Out([_Completion("c", [7], "length")], finished=True)]
    text = parse_text_request({"text_input": _text("P:")}, {"exclude_input_in_output": False,
                                                           "return_num_output_tokens": True}, "m")
    streamed = TextResponder(spec, "1", InferRequest("m", inputs=[]), text, True)
    pieces = [r for r in map(streamed.feed, outs) if r is not None]
    assert [p.outputs[0].data[0] for p in pieces] == [b"P:ab", b"c"]  # the prompt leads the first piece
    assert [int(p.outputs[1].data[0]) for p in pieces] == [1, 2]  # new tokens per response
    whole = TextResponder(spec, "1", InferRequest("m", inputs=[]), text, False)
    last = [whole.feed(o) for o in outs]
    assert last[:2] == [None, None] and last[2].outputs[0].data[0] == b"P:abc"
    assert last[2].parameters == {"finish_reason": "length"}
    with pytest.raises(ModelServerError, match="too long"):
        whole.feed(_Out([_Completion("", [], "abort", "too long")], finished=True))
    with pytest.raises(ModelServerError, match="no outputs"):
        TextResponder(spec, "1", InferRequest("m", inputs=[], requested_outputs=["nope"]), text, True)
