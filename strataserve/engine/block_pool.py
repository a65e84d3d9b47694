"""The KV block pool: fixed-size blocks with reference counts and an LRU-evictable prefix cache.

Invariants
- Every block is either *in use* (ref_cnt > 0) or on the free queue (ref_cnt == 0); never both, never neither.
- Reference counts never go negative: freeing a block that is not in use raises.
- Freeing 0 blocks is always safe; so is looking up a hash that is not cached.
- A full block may carry a content hash (``block_hashes[b]``); a hash maps to at most one block. A cached block
  whose ref_cnt drops to 0 stays findable by its hash until ``allocate`` reuses it (evicts it).
- The free queue is ordered by eviction priority: ``allocate`` takes from its head (least recently freed first);
  ``free`` appends at its tail, in the order given. All operations are O(1) per block.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Iterable

import xxhash


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chained content hash of one full block: xxh3-128 over (parent digest, packed token ids)."""
    h = xxhash.xxh3_128(parent or b"\x00")
    h.update(_pack(token_ids))
    return h.digest()


def _pack(token_ids: list[int]) -> bytes:
    # Token ids fit in 32 bits for every vocabulary we load; array packing is ~10x faster than int.to_bytes.
    return array("I", token_ids).tobytes()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: need at least one KV block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # OrderedDict as an O(1) doubly linked queue: head = next victim.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out (free, including cached-free ones)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def is_free(self, block_id: int) -> bool:
        return self.ref_cnt[block_id] == 0

    # ------------------------------------------------------------------ mutations
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks off the head of the free queue (evicting their cached hashes); ref_cnt becomes 1."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        free, ref, hashes, cached = self._free, self.ref_cnt, self.block_hashes, self._cached
        out = []
        for _ in range(n):
            b, _ = free.popitem(last=False)
            h = hashes[b]
            if h is not None:
                hashes[b] = None
                if cached.get(h) == b:
                    del cached[h]
            ref[b] = 1
            out.append(b)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit); a free block leaves the free queue."""
        ref, free = self.ref_cnt, self._free
        for b in block_ids:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue's tail in the given order."""
        ref, free = self.ref_cnt, self._free
        for b in block_ids:
            c = ref[b]
            if c <= 0:
                raise RuntimeError(f"KV block {b} freed while not in use (ref_cnt={c})")
            ref[b] = c - 1
            if c == 1:
                free[b] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Make a full, computed block findable by its content hash (first writer wins on duplicates)."""
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this copy stays anonymous and is reused first
        self._cached[block_hash] = block_id
        self.block_hashes[block_id] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every content hash (blocks in use keep their data but are no longer shared)."""
        self._cached.clear()
        self.block_hashes = [None] * self.num_blocks

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring (tests and debugging)."""
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} has negative ref_cnt"
            assert (self.ref_cnt[b] == 0) == (b in self._free), f"block {b}: ref_cnt vs free queue mismatch"
        for h, b in self._cached.items():
            assert self.block_hashes[b] == h, f"cache entry for block {b} disagrees with its hash"
