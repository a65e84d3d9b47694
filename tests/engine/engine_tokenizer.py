"""A small byte-level BPE tokenizer built in memory (no downloads), with multi-byte text in its corpus."""
from __future__ import annotations

import functools

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "stop here STOP there; streaming text must never show a stop string.",
    "日本語のテキストと中文文本。 emoji 🙂🚀 and accents: café naïve.",
    "The engine schedules requests; the runner computes tokens.",
] * 20


@functools.lru_cache(maxsize=1)
def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
