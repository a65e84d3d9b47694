"""faster-qwen3-tts (CUDA-graphed talker + code predictor, batch 1) on the benchmark's random reference model.

Its public entry (``FasterQwen3TTS.from_pretrained``) loads a hub/folder checkpoint with a processor and speech
tokenizer; the benchmark has the reference model in memory and times frames only (no codec), so this builds the
wrapper around that model and calls its own input builder and ``fast_generate`` on the benchmark's token ids.
"""
from __future__ import annotations

import time

import torch


class FasterRunner:
    def __init__(self, ref_model, device: str, dtype: torch.dtype, max_seq_len: int = 2048) -> None:
        from faster_qwen3_tts.model import FasterQwen3TTS
        from faster_qwen3_tts.predictor_graph import PredictorGraph
        from faster_qwen3_tts.talker_graph import TalkerGraph
        from qwen_tts import Qwen3TTSModel

        from _tiny_tts import reference_rope

        self.rope = reference_rope  # its graphs build rotary tables: the reference's initialiser must be there
        talker = ref_model.talker
        tcfg = ref_model.config.talker_config
        pred = PredictorGraph(talker.code_predictor, talker.code_predictor.model.config, tcfg.hidden_size,
                              device=device, dtype=dtype, do_sample=False, top_k=50, temperature=0.9)
        with reference_rope():
            tgraph = TalkerGraph(talker.model, tcfg, device=device, dtype=dtype, max_seq_len=max_seq_len)
        self.fq = FasterQwen3TTS(Qwen3TTSModel(ref_model, processor=None), pred, tgraph, device=device, dtype=dtype,
                                 max_seq_len=max_seq_len)
        self.m = ref_model
        self.device = device

    def run(self, text_ids: list[int], frames: int) -> tuple[int, float]:
        """Greedy talker and code predictor, repetition penalty 1.05, up to ``frames`` steps -> (frames, s)."""
        from faster_qwen3_tts.generate import fast_generate

        ids = [torch.tensor([text_ids], device=self.device)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode(), self.rope():
            tie, tam, tth, tpe = self.fq._build_talker_inputs_local(
                m=self.m, input_ids=ids, ref_ids=[None], voice_clone_prompt=None, languages=["english"],
                speakers=["ryan"], non_streaming_mode=False, instruct_ids=[None])
            if not self.fq._warmed_up:
                self.fq.warmup(tie.shape[1])
            self.m.talker.rope_deltas = None
            codes, _ = fast_generate(talker=self.m.talker, talker_input_embeds=tie, attention_mask=tam,
                                     trailing_text_hiddens=tth, tts_pad_embed=tpe, config=self.m.config.talker_config,
                                     predictor_graph=self.fq.predictor_graph, talker_graph=self.fq.talker_graph,
                                     max_new_tokens=frames, min_new_tokens=2, do_sample=False,
                                     subtalker_dosample=False, repetition_penalty=1.05)
        torch.cuda.synchronize()
        return (0 if codes is None else int(codes.shape[0])), time.perf_counter() - t0
