"""Flat batch layout + attention metadata, and the torch paged-attention backend against dense attention."""
from __future__ import annotations

import random

import torch

from strataserve.types.outputs import ScheduledChunk
from strataserve.runner.attention import TorchAttention
from strataserve.runner.input_batch import BlockTableRows, build_input_batch

BS = 4
CPU = torch.device("cpu")


def slot(table, p):
    return table[p // BS] * BS + p % BS


def make_chunks():
    return [
        ScheduledChunk("p0", [11, 12, 13, 14, 15], 0, [7, 2], sample=False),  # first prefill chunk
        ScheduledChunk("d0", [21], 9, [5, 8, 1, 30], sample=True),  # decode at position 9 (+1 lookahead block)
        ScheduledChunk("p1", [31, 32, 33], 6, [9, 4, 6], sample=True),  # chunk after 6 cached tokens
        ScheduledChunk("d1", [41], 2, [3], sample=True),  # short decode: sorted first
    ]


def test_layout_and_generic_metadata():
    chunks = make_chunks()
    b = build_input_batch(chunks, BS, CPU)
    m = b.attn_meta
    # decodes first, shortest context first, then prefills in scheduler order
    assert b.input_ids.tolist() == [41, 21, 11, 12, 13, 14, 15, 31, 32, 33]
    assert b.positions.tolist() == [2, 9, 0, 1, 2, 3, 4, 6, 7, 8]
    expected_slots = [slot([3], 2), slot([5, 8, 1], 9)] + [slot([7, 2], p) for p in range(5)] + \
                     [slot([9, 4, 6], p) for p in (6, 7, 8)]
    assert m.slot_mapping.tolist() == expected_slots
    assert m.num_decode_tokens == 2
    assert m.decode_context_lens.tolist() == [3, 10]
    assert m.decode_block_tables.tolist() == [[3, 0, 0], [5, 8, 1]]  # lookahead block 30 dropped
    assert m.prefill_query_start_loc.tolist() == [2, 7, 10]
    assert m.prefill_context_lens.tolist() == [0, 6]
    assert m.prefill_block_tables.tolist() == [[7, 2, 0], [9, 4, 6]]
    # sampled rows in chunk order: d0 (row 1), p1's last token (row 9), d1 (row 0)
    assert b.sample_chunk_ids == [1, 2, 3]
    assert b.logits_indices.tolist() == [1, 9, 0]
    assert m.prefills[0].block_ids is None and m.prefills[1].block_ids.tolist() == [9, 4, 6]
    assert sum(g.end - g.start for g in m.decode_groups) == 2
    lean = build_input_batch(chunks, BS, CPU, torch_views=False).attn_meta
    assert lean.decode_groups == [] and lean.prefills[1].block_ids is None
    assert torch.equal(lean.slot_mapping, m.slot_mapping)


def dense_reference(q, k, v, n_kv):
    """Causal attention of one sequence's last q.shape[0] queries over all of its k/v (no paging)."""
    hq = q.shape[1]
    k = k.repeat_interleave(hq // n_kv, 1)
    v = v.repeat_interleave(hq // n_kv, 1)
    total, n_q = k.shape[0], q.shape[0]
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    allowed = torch.arange(total)[None, :] <= torch.arange(total - n_q, total)[:, None]
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def test_torch_backend_matches_dense_attention():
    """Random K/V history in scattered blocks + a step mixing 30 decodes and 3 prefill chunks."""
    hq, hkv, d, nblocks = 6, 2, 8, 400
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    free = list(range(nblocks))
    rng.shuffle(free)
    k_cache = torch.zeros(nblocks, BS, hkv, d)
    v_cache = torch.zeros(nblocks, BS, hkv, d)
    att = TorchAttention(hq, hkv, d)
    att.bind_kv_cache([(k_cache, v_cache)])
    seqs, chunks = [], []
    for i in range(33):
        n_new = 1 if i < 30 else rng.randint(2, 9)
        start = rng.randint(0, 40) if i < 30 or i == 31 else 0
        total = start + n_new
        table = [free.pop() for _ in range(-(-total // BS))]
        k_all, v_all = torch.randn(total, hkv, d, generator=gen), torch.randn(total, hkv, d, generator=gen)
        for p in range(start):  # history already in the cache
            k_cache[table[p // BS], p % BS] = k_all[p]
            v_cache[table[p // BS], p % BS] = v_all[p]
        seqs.append((k_all, v_all, start))
        chunks.append(ScheduledChunk(f"r{i}", [0] * n_new, start, table, sample=True))
    b = build_input_batch(chunks, BS, CPU)
    order = sorted(range(30), key=lambda i: chunks[i].start_pos) + list(range(30, 33))
    k_new = torch.cat([seqs[i][0][seqs[i][2]:] for i in order])
    v_new = torch.cat([seqs[i][1][seqs[i][2]:] for i in order])
    q = torch.randn(k_new.shape[0], hq, d, generator=gen)
    out = att.forward(0, q.view(-1, hq * d), k_new.view(-1, hkv * d), v_new.view(-1, hkv * d), b.attn_meta)
    row = 0
    for i in order:
        k_all, v_all, start = seqs[i]
        n = k_all.shape[0] - start
        ref = dense_reference(q[row:row + n], k_all, v_all, hkv)
        torch.testing.assert_close(out[row:row + n].view(n, hq, d), ref, atol=1e-5, rtol=1e-5)
        row += n
    # the step's new K/V landed in their slots
    flat_k = k_cache.view(-1, hkv, d)
    torch.testing.assert_close(flat_k[b.attn_meta.slot_mapping], k_new)


def test_persistent_block_table_rows_match_padding_over_steps_forgets_and_growth():
    """Tables that grow step by step, requests that leave (rows reused) and come back with a new table, more
    requests and longer tables than the rows were sized for: gathered rows always equal the padded lists."""
    rng = random.Random(3)
    rows = BlockTableRows(2, 1)
    live: dict[str, tuple[list[int], int]] = {}  # rid -> (block table, position of its next decode)
    n = 0
    for step in range(60):
        forget = [r for r in live if rng.random() < 0.1]
        for r in forget:
            del live[r]
            rows.forget(r)
        while len(live) < 5 or rng.random() < 0.2:
            live[f"r{n}"] = ([rng.randrange(100) for _ in range(rng.randint(1, 3))], 0)
            n += 1
        chunks = []
        for rid, (table, pos) in list(live.items()):
            pos = min(pos + 1, len(table) * BS - 1) if rng.random() < 0.8 else pos
            if rng.random() < 0.3:  # a new block (possibly ahead of need)
                table.append(rng.randrange(100))
            live[rid] = (table, pos)
            chunks.append(ScheduledChunk(rid, [rng.randrange(50)], pos, table, sample=True))
        got = build_input_batch(chunks, BS, CPU, torch_views=False, rows=rows).attn_meta
        ref = build_input_batch(chunks, BS, CPU, torch_views=False).attn_meta
        assert torch.equal(got.decode_block_tables, ref.decode_block_tables), step
        assert torch.equal(got.slot_mapping, ref.slot_mapping), step
    assert rows.table.shape[0] >= 5 and rows.table.shape[1] > 1  # grew both ways


def test_packed_views_start_on_16_byte_boundaries():
    """The step's index arrays share one transfer; each view must start 16-byte aligned whatever the sizes before
    it, or Triton compiles another variant of a kernel for the misaligned pointer in the middle of a run."""
    from strataserve.runner.input_batch import PACK_ALIGN_BYTES, packed_offsets

    rng = random.Random(0)
    for itemsize in (4, 8):
        for _ in range(200):
            sizes = [rng.choice((0, 1, 3, rng.randint(0, 70))) for _ in range(rng.randint(1, 8))]
            offsets, total = packed_offsets(sizes, itemsize)
            assert all(o * itemsize % PACK_ALIGN_BYTES == 0 for o in offsets)
            ends = [o + n for o, n in zip(offsets, sizes)]
            assert all(e <= nxt for e, nxt in zip(ends, offsets[1:]))  # no overlap, in order
            assert total >= max(ends) and total - sum(sizes) < len(sizes) * PACK_ALIGN_BYTES // itemsize
    assert packed_offsets([5, 2, 4], 4) == ([0, 8, 12], 16)
    assert packed_offsets([3, 1], 8) == ([0, 4], 6)


def test_packed_transfer_keeps_every_array_and_aligns_its_view():
    import numpy as np

    from strataserve.runner.input_batch import PACK_ALIGN_BYTES, _packed

    rng = np.random.default_rng(0)
    for dtype, np_dtype in ((torch.int32, np.int32), (torch.int64, np.int64)):
        arrays = [rng.integers(-9, 9, size=shape).astype(np_dtype) for shape in ((5,), (3, 7), (0,), (1,), (2, 3))]
        views = _packed(arrays, dtype, CPU, pin=False)  # pinning needs an accelerator; the layout is the same
        for a, v in zip(arrays, views):
            assert v.dtype == dtype and tuple(v.shape) == a.shape and np.array_equal(v.numpy(), a)
            assert v.numel() == 0 or v.data_ptr() % PACK_ALIGN_BYTES == 0
