"""Tiny random Qwen3-TTS checkpoints built with the reference package's own classes (``qwen-tts-hf``), and the
reference's own generate / codec decode for comparison.

The reference imports torchaudio at module level, but only its 25 Hz tokenizer (which the 12 Hz checkpoints
never touch) uses it, and torchaudio has no wheel for the CPU torch here: ``import_reference`` installs an empty
stand-in module just for that import and removes it afterwards (test-only shim; nothing of torchaudio runs).

Tiny shapes: codebooks of 64 entries, so the talker's codec vocabulary is 64 + 1,024 special ids (control ids,
speakers and languages live in that top range, which the reference suppresses except eos); 4 code groups; the
speech tokenizer's codebooks (zero sums = silence when freshly built) are filled with random vectors so the
decoded audio is not silent.
"""
from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

from _tiny_models import make_tiny_tokenizer

CODEBOOK = 64
GROUPS = 4
TEXT_VOCAB = 320
SPEAKERS = {"ryan": CODEBOOK + 900, "vivian": CODEBOOK + 901, "eric": CODEBOOK + 902}
LANGUAGES = {"english": CODEBOOK + 10, "chinese": CODEBOOK + 11, "sichuan_dialect": CODEBOOK + 12}


def _unregister_reference_rope() -> None:
    """qwen_tts registers a global "default" RoPE initialiser in transformers that reads ``config.rope_theta``,
    which breaks every later plain ``LlamaConfig`` model in the same process (other tests build those): keep it
    registered only while a reference model is constructed (its rotary modules keep the function they got)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS.get("default")
    if fn is not None and fn.__module__.startswith("qwen_tts"):
        _REFERENCE_ROPE["default"] = ROPE_INIT_FUNCTIONS.pop("default")


_REFERENCE_ROPE: dict[str, Any] = {}


def _mimi_aware(fn):
    """The reference's "default" initialiser reads ``config.rope_theta``, which transformers 5's MimiConfig (the
    speech tokenizer's encoder) keeps in ``rope_parameters``: give Mimi its own default (the same formula)."""
    def init(config, device=None, *args, **kwargs):
        from transformers import MimiConfig
        from transformers.models.mimi.modeling_mimi import MimiRotaryEmbedding

        if isinstance(config, MimiConfig):
            return MimiRotaryEmbedding.compute_default_rope_parameters(config, device)
        return fn(config, device, *args, **kwargs)
    return init


@contextlib.contextmanager
def reference_rope():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ROPE_INIT_FUNCTIONS.update({k: _mimi_aware(v) for k, v in _REFERENCE_ROPE.items()})
    try:
        yield
    finally:
        for k in _REFERENCE_ROPE:
            ROPE_INIT_FUNCTIONS.pop(k, None)


def import_reference() -> types.SimpleNamespace:
    # transformers probes for torchaudio when its lazy modules load: load them before the stand-in exists
    import transformers.modeling_rope_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    if "torchaudio" not in sys.modules:
        try:
            import torchaudio.compliance.kaldi  # noqa: F401
        except Exception:  # noqa: BLE001 - absent or broken: stand in for the import only
            ta, comp, kal = (types.ModuleType(n) for n in
                             ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"))
            comp.kaldi, ta.compliance = kal, comp
            sys.modules.update({"torchaudio": ta, "torchaudio.compliance": comp,
                                "torchaudio.compliance.kaldi": kal})
    import qwen_tts  # noqa: F401  (registers the rope init the configs need)
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder, \
        Qwen3TTSTokenizerV2Model
    from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel  # the voice-clone entry points
    from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer

    for k in [k for k in sys.modules if k.startswith("torchaudio") and sys.modules[k].__spec__ is None]:
        del sys.modules[k]
    _unregister_reference_rope()
    return types.SimpleNamespace(Config=Qwen3TTSConfig, Model=Qwen3TTSForConditionalGeneration,
                                 CodecConfig=Qwen3TTSTokenizerV2Config, Codec=Qwen3TTSTokenizerV2Decoder,
                                 Tokenizer=Qwen3TTSTokenizerV2Model, Wrapper=Qwen3TTSModel,
                                 SpeechTokenizer=Qwen3TTSTokenizer)


def tiny_config(ref, kind: str = "custom_voice", size: str = "1b7", **talker_overrides: Any):
    vocab = CODEBOOK + 1024
    pred = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=CODEBOOK, num_code_groups=GROUPS, rms_norm_eps=1e-6,
                rope_theta=1000000, max_position_embeddings=64)
    talker = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, vocab_size=vocab, num_code_groups=GROUPS,
                  text_hidden_size=40, text_vocab_size=TEXT_VOCAB, rms_norm_eps=1e-6, rope_theta=1000000,
                  max_position_embeddings=1024, codec_pad_id=CODEBOOK + 20, codec_bos_id=CODEBOOK + 21,
                  codec_eos_token_id=CODEBOOK + 22, codec_think_id=CODEBOOK + 23, codec_nothink_id=CODEBOOK + 24,
                  codec_think_bos_id=CODEBOOK + 25, codec_think_eos_id=CODEBOOK + 26,
                  codec_language_id=dict(LANGUAGES), spk_id=dict(SPEAKERS) if kind == "custom_voice" else {},
                  spk_is_dialect={"ryan": False, "vivian": False, "eric": "sichuan_dialect"}
                  if kind == "custom_voice" else {},
                  rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 2], "interleaved": True},
                  code_predictor_config=pred)
    talker.update(talker_overrides)
    # the Base variant's ECAPA-TDNN speaker encoder; its x-vector is a talker row (enc_dim = talker width)
    spk = dict(mel_dim=128, enc_dim=talker["hidden_size"], enc_channels=[16, 16, 16, 16, 48],
               enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8,
               enc_res2net_scale=4, enc_se_channels=8, sample_rate=24000)
    return ref.Config(talker_config=talker, tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size=size,
                      tts_model_type=kind, tts_bos_token_id=TEXT_VOCAB - 3, tts_eos_token_id=TEXT_VOCAB - 2,
                      tts_pad_token_id=TEXT_VOCAB - 1, speaker_encoder_config=spk)


def tiny_codec_config(ref):
    dec = dict(codebook_size=CODEBOOK, codebook_dim=16, num_quantizers=GROUPS, hidden_size=32, latent_dim=16,
               num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=64, num_hidden_layers=2,
               sliding_window=6, upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=32,
               max_position_embeddings=1024)
    # a Mimi encoder downsampling by 8 * 6 * 4 (convs) * 2 (frame rate) = 384: 62.5 frames a second, so that
    # reference clips of a fraction of a second stay short prompts (the decoder's rate does not have to match)
    enc = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
               intermediate_size=32, num_filters=4, upsampling_ratios=[8, 6, 4], codebook_size=CODEBOOK,
               codebook_dim=16, vector_quantization_hidden_dimension=16, num_quantizers=2 * GROUPS,
               num_semantic_quantizers=1, upsample_groups=16, sampling_rate=24000, max_position_embeddings=1024,
               sliding_window=4)
    return ref.CodecConfig(decoder_config=dec, decode_upsample_rate=8, encode_downsample_rate=384,
                           encoder_config=enc, encoder_valid_num_quantizers=GROUPS)


def make_tiny_tts(path: str | Path, kind: str = "custom_voice", size: str = "1b7", seed: int = 0,
                  std: float = 0.3, eos_boost: float = 1.5) -> tuple[Path, Any, Any]:
    """Write a tiny checkpoint folder; returns (path, reference model, reference codec decoder), float32 eval.
    For ``kind="base"`` the third item is the reference's whole speech tokenizer (encoder + ``.decoder``)."""
    from safetensors.torch import save_file

    ref = import_reference()
    path = Path(path)
    (path / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(ref, kind, size)
    torch.manual_seed(seed)
    with reference_rope():
        model = ref.Model(cfg).eval()
    with torch.no_grad():  # larger than HF's init so that codes differ from text to text
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, std)
        # a stronger eos row, so that some clips end by eos within a few frames and others run to the limit
        model.talker.codec_head.weight[cfg.talker_config.codec_eos_token_id] *= eos_boost
    cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 64}))
    tok = make_tiny_tokenizer(TEXT_VOCAB - 5)
    from tokenizers import processors

    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # Qwen2 adds no BOS
    tok.add_tokens(["assistant", "user"])  # so the role wrapper is 3 tokens and the tail 5, as with Qwen2's
    tok.save_pretrained(path)

    ccfg = tiny_codec_config(ref)
    with reference_rope():
        full = ref.Tokenizer(ccfg).eval() if kind == "base" else None
        codec = full.decoder if full is not None else ref.Codec(ccfg.decoder_config).eval()
    with torch.no_grad():
        for name, p in codec.named_parameters():
            if name.endswith("cluster_usage"):
                p.uniform_(0.5, 2.0)
            elif name.endswith("embedding_sum"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("alpha", "beta")):
                p.normal_(0.0, 0.2)
            elif name.endswith(("weight", "gamma", "scale")) and "norm" not in name:
                p.normal_(0.0, 0.15)  # HF's small init (and 1e-6 / 0.01 scales) would leave the audio near silent
    ccfg.save_pretrained(path / "speech_tokenizer")
    state = {f"decoder.{k}": v.contiguous() for k, v in codec.state_dict().items()}
    if full is not None:
        _random_encoder(full.encoder)
        state.update({f"encoder.{k}": v.contiguous() for k, v in full.encoder.state_dict().items()})
        codec = full
    save_file(state, str(path / "speech_tokenizer" / "model.safetensors"))
    return path, model, codec


@torch.no_grad()
def _random_encoder(enc) -> None:
    """Mimi's codebooks start empty (every frame -> code 0): fill them so reference clips get varied codes; give
    its transformer full-strength layer scales and larger weights so that attention (and its window) matters."""
    for name, p in enc.named_parameters():
        if name.startswith("encoder_transformer."):
            if name.endswith("scale"):
                p.fill_(1.0)
            elif name.endswith("proj.weight") or "fc" in name:
                p.normal_(0.0, 0.5)
    for name, b in enc.named_buffers():
        if name.endswith("embed_sum"):
            b.normal_(0.0, 1.0)
        elif name.endswith("cluster_usage"):
            b.uniform_(0.5, 2.0)
        elif name.endswith("initialized"):
            b.fill_(1.0)


def text_ids(tok, text: str) -> list[int]:
    return tok(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]


def instruct_ids(tok, text: str) -> list[int]:
    return tok(f"<|im_start|>user\n{text}<|im_end|>\n")["input_ids"]


@torch.no_grad()
def reference_codes(model, tok, texts: list[str], languages: list[str], speakers: list[str | None],
                    instructions: list[str | None] | None = None, max_new_tokens: int = 24) -> list[list[list[int]]]:
    """The reference's greedy generate (talker and code predictor greedy) -> frames per text."""
    ids = [torch.tensor([text_ids(tok, t)]) for t in texts]
    ins = None
    if instructions is not None:
        ins = [torch.tensor([instruct_ids(tok, t)]) if t else None for t in instructions]
    codes, _ = model.generate(input_ids=ids, instruct_ids=ins, languages=languages, speakers=speakers,
                              max_new_tokens=max_new_tokens, do_sample=False, subtalker_dosample=False)
    return [c.tolist() for c in codes]
