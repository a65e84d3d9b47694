#!/usr/bin/env python3
"""Train the embedded demo model (a tiny LlamaForCausalLM) on the corpus of build_demo_corpus.py.

Seeded and reproducible. Steps: train (or load) a byte-level BPE tokenizer, tokenize the corpus (cached as
.npy next to it), train with plain PyTorch (AdamW, warm-up + cosine, bf16 autocast on CUDA), keep the
weights with the best held-out loss, and save an ordinary HF checkpoint folder.

    # CPU smoke test (seconds):
    python scripts/train_demo_model.py --device cpu --tiny --steps 20 --out /tmp/demo_smoke
    # The shipped model (GPU; ~5 minutes on one H200):
    python scripts/train_demo_model.py --device cuda --time-budget 330 --out OUT --shard-mb 15 --weights-only
    # Join a sharded run into one model.safetensors and add the tokenizer and word list:
    python scripts/train_demo_model.py --assemble OUT --out strataserve/assets/demo_llama
    # fp32 train / held-out loss of the shipped folder:
    python scripts/train_demo_model.py --evaluate strataserve/assets/demo_llama --device cpu
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Rendering must match build_demo_corpus.chat(): "<|role|>\ncontent<|eos|>" per message.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SAMPLE_PROMPTS = ["The weather today is", "Once upon a time, there was a", "A good friend is someone who"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def log(msg: str, fh=None) -> None:
    print(msg, flush=True)
    if fh is not None:
        fh.write(msg + "\n")
        fh.flush()


def read_docs(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train_tokenizer(corpus: Path, vocab_size: int, out_dir: Path):
    """Byte-level BPE: any Unicode string encodes (as bytes) and decodes back exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(read_docs(corpus / "train.jsonl"), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS, clean_up_tokenization_spaces=False,
        model_max_length=1024, chat_template=CHAT_TEMPLATE)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out_dir)
    # Older loaders read the chat template and class from tokenizer_config.json, not chat_template.jinja.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": ROLE_TOKENS},
        indent=2) + "\n")
    return hf


def load_or_train_tokenizer(args):
    from transformers import AutoTokenizer

    if (args.tokenizer_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(args.tokenizer_dir)
    return train_tokenizer(args.corpus, args.vocab_size, args.tokenizer_dir)


def tokenize_split(tokenizer, corpus: Path, split: str) -> np.ndarray:
    """[BOS] doc [EOS] for every document, concatenated; cached as <split>.tokens.npy."""
    cache = corpus / f"{split}.tokens.npy"
    stamp = corpus / f"{split}.tokens.vocab"
    sig = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    if cache.exists() and stamp.exists() and stamp.read_text() == sig:
        return np.load(cache)
    backend = tokenizer.backend_tokenizer
    ids = []
    for enc in backend.encode_batch(read_docs(corpus / f"{split}.jsonl"), add_special_tokens=True):
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(cache, arr)
    stamp.write_text(sig)
    return arr


def build_config(args, tokenizer):
    from transformers import LlamaConfig

    if args.tiny:
        hidden, layers, heads, kv, inter = 64, 2, 2, 1, 128
    else:
        hidden, layers, heads, kv, inter = args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02, attention_dropout=0.0,
        dtype="float32")


@torch.no_grad()
def evaluate(model, data: np.ndarray, seq_len: int, device: str, autocast) -> float:
    """Mean next-token loss over the whole held-out split, in consecutive windows."""
    model.eval()
    n = (len(data) - 1) // seq_len
    x = torch.from_numpy(data[: n * seq_len + 1].astype(np.int64))
    inputs, targets = x[:-1].view(n, seq_len), x[1:].view(n, seq_len)
    total, count = 0.0, 0
    for i in range(0, n, 32):
        inp, tgt = inputs[i:i + 32].to(device), targets[i:i + 32].to(device)
        with autocast():
            logits = model(input_ids=inp).logits
        total += torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), tgt.reshape(-1), reduction="sum").item()
        count += tgt.numel()
    model.train()
    return total / count


def train_sample(train_ids: np.ndarray, n_tokens: int, args) -> np.ndarray:
    """Seeded random windows of the training split, as many tokens as the held-out split: train loss is
    measured on the same footing as held-out loss (whole windows, no sampling noise between runs)."""
    rng = np.random.default_rng(args.seed)
    n = max(1, n_tokens // args.seq_len)
    starts = np.sort(rng.integers(0, len(train_ids) - args.seq_len - 1, n))
    return np.concatenate([train_ids[s:s + args.seq_len] for s in starts] + [train_ids[-1:]])


def evaluate_folder(args) -> None:
    """fp32 train/held-out loss of a saved checkpoint folder (the numbers in the model card)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.evaluate)
    model = AutoModelForCausalLM.from_pretrained(args.evaluate, dtype=torch.float32).to(args.device)
    train_ids, valid_ids = (tokenize_split(tokenizer, args.corpus, s) for s in ("train", "valid"))

    def autocast():
        return torch.autocast("cpu", enabled=False)

    result = {}
    for name, ids in (("train", train_sample(train_ids, len(valid_ids), args)), ("valid", valid_ids)):
        loss = evaluate(model, ids, args.seq_len, args.device, autocast)
        result.update({f"{name}_loss": round(loss, 4), f"{name}_ppl": round(math.exp(loss), 2)})
    print(json.dumps(result))


def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def greedy_samples(model, tokenizer, device: str, new_tokens: int = 48) -> dict[str, str]:
    model.eval()
    out = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        out[prompt] = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    return out


def save_extras(args, out: Path) -> None:
    """Tokenizer files, the training corpus's word list and its manifest, beside the weights."""
    for name in TOKENIZER_FILES + ["chat_template.jinja"]:
        src = args.tokenizer_dir / name
        if src.exists() and src.resolve() != (out / name).resolve():
            shutil.copy(src, out / name)
    words = args.corpus / "words.txt"
    if words.exists():
        with open(words, "rb") as f, gzip.GzipFile(out / "corpus_words.txt.gz", "wb", mtime=0) as g:
            g.write(f.read())
    if (args.corpus / "manifest.json").exists():
        shutil.copy(args.corpus / "manifest.json", out / "corpus_manifest.json")


def assemble(args) -> None:
    """Join the shards of a run folder into one model.safetensors and add tokenizer and word list."""
    from safetensors.torch import load_file, save_file

    src, out = args.assemble, args.out
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(src.glob("model*.safetensors")):
        tensors.update(load_file(shard))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "metrics.json"):
        shutil.copy(src / name, out / name)
    save_extras(args, out)
    print(f"assembled {len(tensors)} tensors into {out / 'model.safetensors'}")


def train(args) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    fh = open(args.out / "train.log", "w")
    tokenizer = load_or_train_tokenizer(args)
    train_ids, valid_ids = (tokenize_split(tokenizer, args.corpus, s) for s in ("train", "valid"))
    log(f"tokens: train {len(train_ids):,} valid {len(valid_ids):,} vocab {len(tokenizer)}", fh)

    config = build_config(args, tokenizer)
    model = LlamaForCausalLM(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"parameters: {n_params:,}  config: {config.to_json_string(use_diff=True)}", fh)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.from_numpy(train_ids.astype(np.int64)).to(args.device)
    offsets = torch.arange(args.seq_len + 1, device=args.device)
    tokens_per_step = args.batch_size * args.seq_len
    epoch_cap = int(args.max_epochs * len(train_ids) / tokens_per_step)
    total = min(args.steps, epoch_cap) if args.steps else epoch_cap
    best = {"valid_loss": float("inf")}
    start = time.perf_counter()
    history = []
    step = 0
    model.train()
    while step < total:
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = data[starts.to(args.device)[:, None] + offsets]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args)
        with autocast():
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == args.calibrate_at and args.time_budget:
            # Fit the cosine schedule to the time budget once the step time is known.
            per_step = (time.perf_counter() - start) / step
            total = max(step + 1, min(total, int(args.time_budget / per_step)))
            log(f"calibrated: {per_step * 1000:.1f} ms/step, {tokens_per_step / per_step:,.0f} tok/s, "
                f"total steps {total} ({total * tokens_per_step / len(train_ids):.1f} epochs)", fh)
        if step % args.eval_every == 0 or step == total:
            train_loss = loss.item()
            valid_loss = evaluate(model, valid_ids, args.seq_len, args.device, autocast)
            elapsed = time.perf_counter() - start
            history.append({"step": step, "train_loss": train_loss, "valid_loss": valid_loss, "time_s": elapsed})
            log(f"step {step}/{total} lr {lr_at(step - 1, total, args):.2e} train {train_loss:.4f} "
                f"valid {valid_loss:.4f} ppl {math.exp(valid_loss):.2f} "
                f"epoch {step * tokens_per_step / len(train_ids):.2f} {elapsed:.0f}s", fh)
            if valid_loss < best["valid_loss"]:
                best = {"valid_loss": valid_loss, "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    train_time = time.perf_counter() - start
    model.load_state_dict(best.pop("state"))
    final_train = evaluate(model, train_sample(train_ids, len(valid_ids), args), args.seq_len, args.device,
                           autocast)
    final_valid = evaluate(model, valid_ids, args.seq_len, args.device, autocast)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.7, top_p=0.9)
    samples = greedy_samples(model, tokenizer, args.device)
    metrics = {
        "parameters": n_params, "steps": step, "best_step": best["step"], "train_time_s": round(train_time, 1),
        "tokens_per_step": tokens_per_step, "train_tokens": int(len(train_ids)),
        "valid_tokens": int(len(valid_ids)), "epochs": round(step * tokens_per_step / len(train_ids), 2),
        "train_loss": round(final_train, 4), "train_ppl": round(math.exp(final_train), 2),
        "valid_loss": round(final_valid, 4), "valid_ppl": round(math.exp(final_valid), 2),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "seed": args.seed,
        "args": {k: str(v) for k, v in vars(args).items()}, "samples_greedy": samples, "history": history,
    }
    log(json.dumps({k: v for k, v in metrics.items() if k not in ("history", "args")}, indent=1), fh)
    model.to(torch.float32)
    shard = f"{args.shard_mb}MB" if args.shard_mb else "1GB"
    model.save_pretrained(args.out, max_shard_size=shard)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    if not args.weights_only:
        save_extras(args, args.out)
    fh.close()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train the strataserve demo Llama model.")
    ap.add_argument("--corpus", type=Path, default=Path(".demo_corpus"))
    ap.add_argument("--tokenizer-dir", type=Path, default=Path("strataserve/assets/demo_llama"),
                    help="loads tokenizer.json from here, or trains one and saves it here")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--assemble", type=Path, help="join a sharded run folder into --out and stop")
    ap.add_argument("--evaluate", type=Path, help="print fp32 train/held-out loss of this folder and stop")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=576)
    ap.add_argument("--max-positions", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide model, for smoke tests")
    ap.add_argument("--steps", type=int, default=0, help="0: as many as --max-epochs/--time-budget allow")
    ap.add_argument("--max-epochs", type=float, default=40.0)
    ap.add_argument("--time-budget", type=float, default=0.0, help="seconds of training; 0: no limit")
    ap.add_argument("--calibrate-at", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--shard-mb", type=int, default=0, help="split weights into shards of this size")
    ap.add_argument("--weights-only", action="store_true", help="do not copy tokenizer and word list to --out")
    return ap.parse_args()


if __name__ == "__main__":
    cli = parse_args()
    if cli.evaluate:
        evaluate_folder(cli)
    elif cli.out is None:
        raise SystemExit("give --out (or --evaluate DIR)")
    else:
        assemble(cli) if cli.assemble else train(cli)
