"""Build one request's talker prompt from text ids, as the reference's ``generate`` does (non-streaming-text
mode off): the prompt embeddings, the text rows fed one per generated frame, and the pad
row fed after the text runs out.

Text ids are ``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`` tokenised: the first 3 are the
role, id 3 is the first text token (it enters the prompt), ids 4..-5 trail (one per frame), then ``tts_eos``.
Layout of the prompt: [instruction rows] + role(3) + (tts_pad... tts_bos) + codec control ids + first text token
+ codec bos, where the codec control ids are think/nothink, think_bos, [language], think_eos, [speaker], pad.
A cloned voice (Base checkpoints) puts its x-vector in the speaker's row; in-context cloning also replaces the
last row by the reference block (reference text beside the reference's codec frames, see ``_reference_block``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from strataserve.models.qwen3_tts.config import Qwen3TTSConfig
from strataserve.models.qwen3_tts.talker import Qwen3TTSTalker

#: tokens of the assistant wrapper around the text: 3 before it, 5 after it
ROLE_TOKENS, TAIL_TOKENS = 3, 5
#: ... around a voice clone's reference text (``<|im_start|>assistant\n{ref_text}<|im_end|>\n``): 3 and 2
REF_ROLE_TOKENS, REF_TAIL_TOKENS = 3, 2


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
                 instruct_ids: list[int] | None = None, *, speaker_embed: torch.Tensor | None = None,
                 ref_ids: list[int] | None = None, ref_codes: torch.Tensor | None = None) -> TalkerPrompt:
    """``speaker`` names a preset voice; ``speaker_embed`` (a cloned voice's x-vector) takes its row instead;
    ``ref_ids`` + ``ref_codes`` (in-context cloning) replace the first text token by the reference block."""
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
    rows = [model.codec_embed(torch.tensor(control, device=dev))]
    if speaker_embed is not None:
        rows.append(speaker_embed.to(dev, model.dtype).reshape(1, -1))
    rows.append(model.codec_embed(torch.tensor([cfg.codec_pad_id, cfg.codec_bos_id], device=dev)))
    codec = torch.cat(rows, dim=0)  # [C, H]
    n = codec.shape[0]
    text_side = torch.cat([pad.expand(n - 2, -1), bos[None]], dim=0)  # tts_pad * (C-2) + tts_bos
    parts = [model.text_embed(ids[:ROLE_TOKENS]), text_side + codec[:-1]]
    if ref_codes is not None:
        icl, trailing = _reference_block(model, ids, ref_ids or [], ref_codes, codec[-1:], eos, pad)
        parts.append(icl)
    else:
        parts.append(model.text_embed(ids[ROLE_TOKENS:ROLE_TOKENS + 1]) + codec[-1:])
        trailing = torch.cat([model.text_embed(ids[ROLE_TOKENS + 1:-TAIL_TOKENS]), eos[None]], dim=0)
    if instruct_ids:
        parts.insert(0, model.text_embed(torch.tensor(instruct_ids, device=dev)))
    return TalkerPrompt(torch.cat(parts, dim=0), trailing, pad)


def _reference_block(model: Qwen3TTSTalker, ids: torch.Tensor, ref_ids: list[int], ref_codes: torch.Tensor,
                     codec_bos: torch.Tensor, eos: torch.Tensor, pad: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """In-context cloning, text streamed beside the codes as the reference's default (non_streaming_mode off)
    does: text rows = reference text + target text + tts_eos; codec rows = codec bos + the reference's frames;
    the two run side by side; text left over trails one row per generated frame, or tts_pad fills the text
    side when the codes are longer. ``ref_ids`` is ``<|im_start|>assistant\n{ref_text}<|im_end|>\n``."""
    if len(ref_ids) <= REF_ROLE_TOKENS + REF_TAIL_TOKENS:
        raise ValueError("ref_text is empty after tokenisation: give the words spoken in ref_audio")
    text_ids = torch.cat([torch.tensor(ref_ids[REF_ROLE_TOKENS:-REF_TAIL_TOKENS], device=ids.device),
                          ids[ROLE_TOKENS:-TAIL_TOKENS]])
    text = torch.cat([model.text_embed(text_ids), eos[None]], dim=0)
    codec = torch.cat([codec_bos, model.frame_embed(ref_codes.to(model.device))], dim=0)
    lt, lc = text.shape[0], codec.shape[0]
    if lt > lc:
        return text[:lc] + codec, text[lc:]
    return torch.cat([text, pad.expand(lc - lt, -1)], dim=0) + codec, text[:0]
