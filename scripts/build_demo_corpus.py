#!/usr/bin/env python3
"""Assemble the demo model's training corpus from Debian package files, reproducibly.

Every source is public domain or permissively licensed and installs offline from Debian:

    apt-get install bible-kjv bible-kjv-text fortunes fortunes-min jargon-text \
        r-cran-janeaustenr wordnet-base python3.11-doc

Output (in --out, which is not committed: it is ~20 MB):
    train.jsonl / valid.jsonl   one {"source", "text"} document per line; ~1% of documents held out
    manifest.json               per-source licence, package, document count and character count
    words.txt                   sorted lower-case alphabetic words of the training split

WordNet entries are rendered as short chat exchanges (the template the demo tokenizer ships), so the
model sees the chat markup it is served with. Chat documents are stored with the markup already in.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import unicodedata
from collections.abc import Iterator
from pathlib import Path

# The tokens and layout shared with scripts/train_demo_model.py and the shipped chat template.
EOS = "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}

SOURCES = {
    "austen": ("r-cran-janeaustenr", "MIT (package); novels public domain", "Jane Austen's six novels"),
    "kjv": ("bible-kjv-text", "public domain (1611 translation); package: unrestricted use",
            "King James Version of the Bible"),
    "fortunes": ("fortunes, fortunes-min", "BSD (fortune-mod)", "fortune cookie quotations (non-offensive)"),
    "jargon": ("jargon-text", "public domain", "The Jargon File 4.4.7 lexicon entries"),
    "wordnet": ("wordnet-base", "WordNet 3.0 licence (permissive, BSD-like)",
                "WordNet 3.0 definitions and example sentences, as Q&A chats"),
    "pydoc": ("python3.11-doc", "PSF licence", "prose paragraphs of the Python 3.11 documentation"),
}


def clean(text: str) -> str:
    """NFC, no control characters except newline, no trailing spaces, at most one blank line."""
    text = unicodedata.normalize("NFC", text).replace("\r", "").replace("\t", " ")
    text = "".join(ch for ch in text if ch == "\n" or unicodedata.category(ch)[0] != "C")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def unwrap(lines: list[str]) -> str:
    """Join hard-wrapped lines into paragraphs separated by blank lines."""
    paras, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


def austen() -> Iterator[tuple[str, str]]:
    """Chapters of the six novels; _emphasis_ underscores are dropped."""
    r = ("library(janeaustenr); b <- austen_books(); "
         "cat(paste(as.character(b$book), gsub('\\t', ' ', b$text), sep='\\t'), sep='\\n')")
    out = subprocess.run(["Rscript", "-e", r], check=True, capture_output=True, text=True).stdout
    chapter: list[str] = []
    key, book_now = "", ""
    for i, row in enumerate(out.split("\n")):
        book, _, line = row.partition("\t")
        if book != book_now or re.match(r"^\s*(CHAPTER|Chapter) ", line):
            if chapter:
                yield key, re.sub(r"_([^_\n]+)_", r"\1", unwrap(chapter))
            chapter, key, book_now = [], f"{book}#{i}", book
            if book_now and re.match(r"^\s*(CHAPTER|Chapter) ", line):
                continue
        chapter.append(line)
    if chapter:
        yield key, re.sub(r"_([^_\n]+)_", r"\1", unwrap(chapter))


def kjv() -> Iterator[tuple[str, str]]:
    out = subprocess.run(["bible", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    title, verses = "", []
    for line in out.split("\n"):
        if re.match(r"^\S.* \d+$", line) and not line.startswith(" "):
            if verses:
                yield title, " ".join(verses)
            title, verses = line.strip(), []
        elif m := re.match(r"^\s+\d+ (.*)$", line):
            verses.append(m.group(1).strip())
        elif line.strip() and verses:
            verses[-1] += " " + line.strip()
    if verses:
        yield title, " ".join(verses)


def fortunes() -> Iterator[tuple[str, str]]:
    root = Path("/usr/share/games/fortunes")
    for path in sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink() and p.suffix == ""):
        raw = path.read_bytes().decode("utf-8", errors="replace")
        for j, cookie in enumerate(raw.split("\n%\n")):
            text = "\n".join(re.sub(r"^\s+(--\s)", r"\1", ln) for ln in cookie.split("\n"))
            if text.strip() and len(text) < 4000:
                yield f"{path.name}#{j}", text


def jargon() -> Iterator[tuple[str, str]]:
    lines = gzip.open("/usr/share/doc/jargon-text/jargon.txt.gz", "rt", encoding="utf-8").read().split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("   :") and i > 2000)
    end = next(i for i, ln in enumerate(lines) if re.match(r"^Appendix\W+A\W", ln))
    head, body = "", []
    for line in lines[start:end] + ["   :END:"]:
        if m := re.match(r"^   :([^:]+):(.*)$", line):
            if head and body:
                yield head, f"{head}:{unwrap(body)}".replace("{", "").replace("}", "")
            head, body = m.group(1).strip(), [m.group(2)]
        elif not re.match(r"^\S", line):
            body.append(line)


def chat(user: str, assistant: str) -> str:
    return f"{ROLE_TOKENS['user']}\n{user}{EOS}{ROLE_TOKENS['assistant']}\n{assistant}"


def wordnet() -> Iterator[tuple[str, str]]:
    for pos, name in (("n", "noun"), ("v", "verb"), ("a", "adj"), ("r", "adv")):
        for line in open(f"/usr/share/wordnet/data.{name}", encoding="utf-8", errors="replace"):
            if line.startswith(" ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            words = [parts[4 + 2 * k].replace("_", " ") for k in range(int(parts[3], 16))]
            words = [re.sub(r"\(\w+\)$", "", w) for w in words]
            examples = re.findall(r'"([^"]+)"', gloss)
            definition = re.split(r';\s*"', gloss)[0].strip().rstrip(";").strip()
            if not examples:  # keeps WordNet to ~1/4 of the corpus, favouring everyday senses
                continue
            word = words[0]
            answer = f"{word[0].upper() + word[1:]} means {definition}."
            if len(words) > 1:
                answer += f" Other words for it: {', '.join(words[1:4])}."
            if examples:
                answer += f" For example: \"{examples[0]}\"."
            question = f'What does "{word}" mean?' if pos != "n" else f"What is {word}?"
            yield f"{pos}{parts[0]}", chat(question, answer)


def pydoc(limit_chars: int = 3_000_000) -> Iterator[tuple[str, str]]:
    text = gzip.open("/usr/share/info/python3.11.info.gz", "rt", encoding="utf-8", errors="replace").read()
    total = 0
    for j, para in enumerate(text.split("\n\n")):
        lines = para.split("\n")
        if any(ln.startswith(("     ", "* ", "\x1f", "File:", "   * ")) for ln in lines):
            continue
        joined = " ".join(ln.strip() for ln in lines)
        letters = sum(c.isalpha() or c == " " for c in joined)
        if len(joined) < 200 or letters < 0.9 * len(joined) or joined.count(". ") < 2:
            continue
        yield f"p{j}", joined
        total += len(joined)
        if total >= limit_chars:
            return


GENERATORS = {"austen": austen, "kjv": kjv, "fortunes": fortunes, "jargon": jargon,
              "wordnet": wordnet, "pydoc": pydoc}


def held_out(source: str, key: str, percent: float) -> bool:
    digest = hashlib.sha256(f"{source}/{key}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 10000 < percent * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".demo_corpus"))
    ap.add_argument("--valid-percent", type=float, default=1.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest, words = {}, set()
    with open(args.out / "train.jsonl", "w", encoding="utf-8") as ftr, \
            open(args.out / "valid.jsonl", "w", encoding="utf-8") as fva:
        for source, gen in GENERATORS.items():
            stats = {"train_docs": 0, "valid_docs": 0, "train_chars": 0, "valid_chars": 0}
            for key, text in gen():
                text = clean(text)
                if len(text) < 20:
                    continue
                split = "valid" if held_out(source, key, args.valid_percent) else "train"
                (fva if split == "valid" else ftr).write(json.dumps({"source": source, "text": text}) + "\n")
                stats[f"{split}_docs"] += 1
                stats[f"{split}_chars"] += len(text)
                if split == "train":
                    words.update(w.lower() for w in re.findall(r"[^\W\d_]+", re.sub(r"<\|\w+\|>", " ", text)))
            package, licence, what = SOURCES[source]
            manifest[source] = {"package": package, "licence": licence, "content": what, **stats}
            print(source, stats, flush=True)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (args.out / "words.txt").write_text("\n".join(sorted(words)) + "\n")
    print("words:", len(words))


if __name__ == "__main__":
    main()
