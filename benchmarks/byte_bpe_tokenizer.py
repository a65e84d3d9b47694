"""Train a byte-level BPE tokenizer in the style of Qwen's (its pre-tokenizer split, GPT-2 byte alphabet, ChatML
special tokens) to Qwen3's 151,643 regular tokens, on local text, and save it in HF format.

The random-weight benchmark checkpoints carry a word-level tokenizer, which cannot spell JSON; structured-output
figures need one that spells text in bytes, with a vocabulary of the real size (the grammar engine's work per
token scales with it). No hub download is possible, so the tokenizer is trained here. Run 29 used one trained on
the CPU machine's Python standard library plus the project venv's sources (~178 MB, 45 s on one thread):

    python benchmarks/byte_bpe_tokenizer.py OUT_DIR [--vocab-size 151643] FILE...
"""
from __future__ import annotations

import argparse
import time

# Qwen2/3's pre-tokenizer pattern (contractions, letters with one leading non-letter, single digits, punctuation
# runs, newlines, spaces), as its tokenizer.json declares it
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("files", nargs="+")
    p.add_argument("--vocab-size", type=int, default=151643)
    args = p.parse_args(argv)
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(args.files, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(
        args.out)
    print(f"vocab={tok.get_vocab_size()} train_s={time.perf_counter() - t0:.1f} out={args.out}")


if __name__ == "__main__":
    main()
