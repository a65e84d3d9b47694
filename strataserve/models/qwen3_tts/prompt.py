"""Build one request's talker prompt from text ids, as the reference's ``generate`` does (non-streaming-text
mode off, no voice-clone prompt): the prompt embeddings, the text rows fed one per generated frame, and the pad
row fed after the text runs out.

Text ids are ``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`` tokenised: the first 3 are the
role, id 3 is the first text token (it enters the prompt), ids 4..-5 trail (one per frame), then ``tts_eos``.
Layout of the prompt: [instruction rows] + role(3) + (tts_pad... tts_bos) + codec control ids + first text token
+ codec bos, where the codec control ids are think/nothink, think_bos, [language], think_eos, [speaker], pad.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strataserve.models.qwen3_tts.config import Qwen3TTSConfig
from strataserve.models.qwen3_tts.talker import Qwen3TTSTalker

#: tokens of the assistant wrapper around the text: 3 before it, 5 after it
ROLE_TOKENS, TAIL_TOKENS = 3, 5


@dataclass(frozen=True)
class TalkerPrompt:
    embeds: torch.Tensor  # [P, H] prompt rows
    text_rows: torch.Tensor  # [L, H] rows added to frames 0..L-1 (the trailing text, then tts_eos)
    pad_row: torch.Tensor  # [H] added to every frame from L on

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])

    def text_row(self, frame: int) -> torch.Tensor:
        return self.text_rows[frame] if frame < self.text_rows.shape[0] else self.pad_row


def language_id(cfg: Qwen3TTSConfig, language: str, speaker: str | None) -> int | None:
    """The codec language id (None for "auto"); a dialect speaker picks its dialect for chinese/auto."""
    lang = language.lower()
    lid = None if lang == "auto" else cfg.language_ids[lang]
    if lang in ("chinese", "auto") and speaker and cfg.speaker_dialect.get(speaker.lower()):
        lid = cfg.language_ids[cfg.speaker_dialect[speaker.lower()]]  # type: ignore[index]
    return lid


@torch.inference_mode()
def build_prompt(model: Qwen3TTSTalker, text_ids: list[int], language: str, speaker: str | None,
                 instruct_ids: list[int] | None = None) -> TalkerPrompt:
    cfg = model.config
    if len(text_ids) < ROLE_TOKENS + 1 + TAIL_TOKENS:
        raise ValueError("the text is empty after tokenisation: give at least one character to speak")
    dev = model.device
    ids = torch.tensor(text_ids, device=dev)
    bos, eos, pad = model.text_embed(torch.tensor([cfg.tts_bos_id, cfg.tts_eos_id, cfg.tts_pad_id], device=dev))
    lid = language_id(cfg, language, speaker)
    control = ([cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id] if lid is None else
               [cfg.codec_think_id, cfg.codec_think_bos_id, lid, cfg.codec_think_eos_id])
    if speaker:
        control.append(cfg.speakers[speaker.lower()])
    control += [cfg.codec_pad_id, cfg.codec_bos_id]
    codec = model.codec_embed(torch.tensor(control, device=dev))  # [C, H]
    n = codec.shape[0]
    text_side = torch.cat([pad.expand(n - 2, -1), bos[None]], dim=0)  # tts_pad * (C-2) + tts_bos
    parts = [model.text_embed(ids[:ROLE_TOKENS]), text_side + codec[:-1],
             model.text_embed(ids[ROLE_TOKENS:ROLE_TOKENS + 1]) + codec[-1:]]
    if instruct_ids:
        parts.insert(0, model.text_embed(torch.tensor(instruct_ids, device=dev)))
    trailing = torch.cat([model.text_embed(ids[ROLE_TOKENS + 1:-TAIL_TOKENS]), eos[None]], dim=0)
    return TalkerPrompt(torch.cat(parts, dim=0), trailing, pad)
