"""LLM models in the repository: served by AsyncLLM, equal to the engine's own output, usable in ensembles."""

from __future__ import annotations

import numpy as np
import pytest
from _model_repos import add_python_text, write_config
from _tiny_models import make_tiny_checkpoint
from ms_helpers import expect_error, outputs, request, run, serving

from strataserve.config import EngineConfig, ModelConfig
from strataserve.engine.async_llm import AsyncLLM
from strataserve.types.sampling import SamplingParams

PARAMS = {"max_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def llm_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    make_tiny_checkpoint("llama", repo / "tiny_llm")  # a bare HF folder placed as a model
    add_python_text(repo)
    write_config(repo / "shout_then_llm", """
        platform: "ensemble"
        max_batch_size: 0
        input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] } ]
        output [ { name: "ANSWER" data_type: TYPE_STRING dims: [ 1 ] } ]
        ensemble_scheduling { step [
          { model_name: "py_text" input_map { key: "text_input" value: "PROMPT" }
            output_map { key: "text_output" value: "LOUD" } },
          { model_name: "tiny_llm" input_map { key: "text_input" value: "LOUD" }
            output_map { key: "text_output" value: "ANSWER" } }
        ] }
    """)
    (repo / "llm_cfg" / "1").mkdir(parents=True)  # the config form: backend llm, checkpoint named by parameter
    write_config(repo / "llm_cfg", f"""
        backend: "llm"
        parameters {{ key: "model" value: {{ string_value: "{repo / 'tiny_llm'}" }} }}
    """)
    return repo


def _direct(path, prompts: list[str]) -> list[str]:
    async def main():
        llm = AsyncLLM.from_config(EngineConfig(ModelConfig(model=str(path))))
        try:
            texts = []
            for i, p in enumerate(prompts):
                text = ""
                async for out in llm.generate(p, SamplingParams(**PARAMS), f"ref-{i}"):
                    text = out.outputs[0].text  # vLLM's default kind: the text so far
                texts.append(text)
            return texts
        finally:
            llm.shutdown()

    return run(main())


def test_llm_model_generate_stream_and_ensemble(llm_repo):
    want_plain, want_loud = _direct(llm_repo / "tiny_llm", ["hello there", "HELLO THERE"])

    async def main():
        async with serving(llm_repo) as server:
            gen = await server.generate("tiny_llm", "", {"text_input": "hello there"}, PARAMS)
            cfg_gen = await server.generate("llm_cfg", "1", {"text_input": "hello there"}, PARAMS)
            assert not server.is_decoupled("llm_cfg") and cfg_gen["text_output"] == gen["text_output"]
            chunks = [c async for c in server.generate_stream("tiny_llm", "", {"text_input": "hello there"}, PARAMS)]
            req = request("shout_then_llm", PROMPT=np.array([b"hello there"], dtype=object))
            req.parameters = dict(PARAMS)
            ens = await server.infer(req)
            await expect_error("invalid_argument", server.generate("tiny_llm", "", {"text_input": "x"}, {"bogus": 1}),
                               "unknown parameters ['bogus']")
            await expect_error("invalid_argument", server.generate("tiny_llm", "", {"text_input": "x"},
                                                                   {"temperature": -1.0}), "temperature")
            return gen, chunks, ens, server.is_decoupled("tiny_llm"), server.model_metadata("tiny_llm"), \
                server.statistics("tiny_llm")["model_stats"][0]

    gen, chunks, ens, decoupled, meta, stats = run(main())
    assert want_plain and gen["text_output"] == want_plain
    assert len(chunks) > 1 and "".join(c["text_output"] for c in chunks) == want_plain
    assert chunks[-1]["model_name"] == "tiny_llm"
    assert outputs(ens)["ANSWER"][0].decode() == want_loud
    # Triton's vLLM-backend tensors; not decoupled (infer answers the whole text, streams send pieces)
    assert not decoupled and meta["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": [1]}
    assert {i["name"] for i in meta["inputs"]} >= {"stream", "sampling_parameters", "exclude_input_in_output"}
    assert stats["inference_stats"]["success"]["count"] == 3 and stats["inference_stats"]["fail"]["count"] == 2
