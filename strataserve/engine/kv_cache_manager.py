"""Per-request view of the KV block pool: the only KV interface the scheduler uses.

The scheduler asks three things: which leading blocks of a request are already cached
(``get_computed_blocks``), room for N more tokens (``allocate_slots``, None = not enough blocks) and to give a
request's blocks back (``free``). Content hashes, reference counts and eviction stay inside ``BlockPool``.

A full block is registered in the prefix cache only after its KV has been computed (``cache_computed``, called
after each step), so no request ever reads a block that the same forward pass is still writing. Blocks that the
current step will complete are remembered as *in flight* so the scheduler can hold back a request whose next
block another request is computing right now (``prefix_in_flight``): it then hits the cache a step later
instead of computing the same KV twice. That is how ``n > 1`` siblings and concurrent requests with a common
system prompt share prompt blocks.
"""
from __future__ import annotations

from strataserve.engine.block_pool import BlockPool, hash_block
from strataserve.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[int]] = {}  # request id -> its block table
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already in the prefix cache
        self._in_flight: set[bytes] = set()  # hashes of full blocks the current step is computing
        self.prefix_cache_queries = 0  # tokens looked up (cumulative)
        self.prefix_cache_hits = 0  # tokens found

    # ------------------------------------------------------------------ stats
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    # ------------------------------------------------------------------ prefix cache
    def _hashes(self, request: Request, n: int) -> list[bytes]:
        """The request's first ``n`` full-block hashes, extending its memo (each block hashed once per life)."""
        hashes = request.block_hashes
        if len(hashes) < n:
            bs, toks = self.block_size, request.all_token_ids
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), n):
                parent = hash_block(parent, toks[i * bs:(i + 1) * bs])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of ``request`` in whole blocks, as (block ids, number of tokens).

        Never the whole sequence: the last token is always computed so the runner has logits to sample from.
        """
        if not self.enable_caching:
            return [], 0
        n_full = (request.num_tokens - 1) // self.block_size
        lookup = self.pool.lookup
        hit: list[int] = []
        for h in self._hashes(request, n_full)[:n_full]:
            b = lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit, len(hit) * self.block_size

    def prefix_in_flight(self, request: Request, num_hit_blocks: int) -> bool:
        """True when the block right after the cached prefix is being computed by another request this step."""
        if not self._in_flight or num_hit_blocks >= (request.num_tokens - 1) // self.block_size:
            return False
        return self._hashes(request, num_hit_blocks + 1)[num_hit_blocks] in self._in_flight

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix-cache query (called once per admission, not per retry)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def begin_step(self) -> None:
        self._in_flight.clear()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None,
                       reserve_blocks: int = 0) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones (and after
        ``new_computed_blocks``, prefix-cache hits from ``get_computed_blocks`` that it now takes a reference on).

        Returns the request's whole block table, or None (changing nothing) when fewer than
        needed + ``reserve_blocks`` blocks are free.
        """
        rid, bs = request.request_id, self.block_size
        blocks = self._blocks.get(rid)
        if blocks is not None and not new_computed_blocks:  # hot path: a decode step inside its last block
            done = request.num_computed_tokens
            total = done + num_new_tokens
            if total <= len(blocks) * bs and (total // bs == done // bs or not self.enable_caching):
                return blocks
        pool = self.pool
        if blocks is None:
            blocks = self._blocks[rid] = []
        n_hit = len(new_computed_blocks) if new_computed_blocks else 0
        done = request.num_computed_tokens + n_hit * bs
        total = done + num_new_tokens
        need = -(-total // bs) - len(blocks) - n_hit
        if need > 0 or n_hit:
            free = pool.num_free_blocks
            if n_hit:  # hits sitting on the free queue stop being allocatable once we reference them
                ref = pool.ref_cnt
                free -= sum(1 for b in new_computed_blocks if ref[b] == 0)  # type: ignore[union-attr]
            if need + reserve_blocks > free:
                if not blocks:
                    del self._blocks[rid]
                return None
            if n_hit:
                pool.touch(new_computed_blocks)  # type: ignore[arg-type]
                blocks.extend(new_computed_blocks)  # type: ignore[arg-type]
                self._num_registered[rid] = len(blocks)
            if need > 0:
                blocks.extend(pool.allocate(need))
        # Only blocks whose tokens are all known can be hashed (a token still being sampled is not).
        last = min(total, len(request.all_token_ids)) // bs
        if self.enable_caching and last > done // bs:
            first = done // bs
            self._in_flight.update(self._hashes(request, last)[first:last])
        return blocks

    def cache_computed(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed in the prefix cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        if request.num_computed_tokens < (start + 1) * self.block_size:
            return  # hot path: no block completed since the last call
        blocks = self._blocks.get(rid)
        if not blocks:
            return
        # computed AND known: with async scheduling the step in flight may compute a token not yet known here
        n_full = min(min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size, len(blocks))
        if n_full <= start:
            return
        hashes = self._hashes(request, n_full)
        cache = self.pool.cache_block
        for i in range(start, n_full):
            cache(blocks[i], hashes[i])
        self._num_registered[rid] = n_full

    def free(self, request: Request) -> None:
        """Give back every block of the request (computed full blocks stay cached). Safe for unknown requests."""
        rid = request.request_id
        if rid in self._blocks:
            self.cache_computed(request)
            blocks = self._blocks.pop(rid)
            # Tail blocks first: they are the least likely to be shared, so they should be evicted first.
            self.pool.free(reversed(blocks))
        self._num_registered.pop(rid, None)
