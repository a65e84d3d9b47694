"""``apply_token_bitmask`` against a per-element reference: odd vocabularies, subsets of rows, padded widths."""
from __future__ import annotations

import pytest
import torch

from strataserve.runner.logits_mask import allowed_tokens, apply_token_bitmask


def _reference(logits, rows, bitmask):
    out = logits.clone()
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            word = t // 32
            ok = word < bitmask.shape[1] and (int(bitmask[j, word]) >> (t % 32)) & 1
            if not ok:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,width", [(37, 2), (64, 2), (100, 3), (70, 2)])  # 70 > 64: ids past the mask
def test_bitmask_matches_reference(vocab, width):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    bits = torch.randint(0, 2, (3, width * 32), generator=g).bool()
    words = (bits.view(3, width, 32).int() << torch.arange(32, dtype=torch.int32)).sum(-1, dtype=torch.int64)
    bitmask = words.to(torch.int64).apply_(lambda w: w - (1 << 32) if w >= (1 << 31) else w).to(torch.int32)
    for rows in ([0, 2, 4], [1, 2, 3]):
        got = logits.clone()
        apply_token_bitmask(got, rows, bitmask)
        assert torch.equal(got, _reference(logits, rows, bitmask))
    full = logits[:3].clone()
    apply_token_bitmask(full, [0, 1, 2], bitmask)
    assert torch.equal(full, _reference(logits[:3], [0, 1, 2], bitmask))
    # the device-agnostic unpack (used on accelerators) against the same reference
    torch_path = logits[:3].clone().masked_fill_(~allowed_tokens(bitmask, vocab), float("-inf"))
    assert torch.equal(torch_path, _reference(logits[:3], [0, 1, 2], bitmask))


def test_bitmask_row_count_must_match():
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(torch.zeros(2, 8), [0, 1], torch.zeros(1, 1, dtype=torch.int32))
