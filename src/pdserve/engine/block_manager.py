"""KV-cache block allocation with reference counts and a prefix cache. Plain Python, no tensors.

A full block is keyed by a hash of its tokens chained to the hash of the block before it, so equal keys
mean equal prefixes. When its last holder frees it, a keyed block stays cached (reusable by the next
request with the same prefix) until a new table needs it: cached blocks are evicted oldest first, with the free
blocks around them when no free run holds the table, never passing a block that served a prefix hit.

Free blocks are handed out in runs of consecutive ids where the pool allows: a sequence's table grows from the
block after its last one, and a new run is cut best-fit from the free runs. A KV transfer moves a run of blocks
straight from and into the cache, without a gather or scatter copy (`pdserve.transfer.blocks`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from pdserve.engine.cache_journal import PrefixCacheJournal
from pdserve.engine.free_runs import FreeRuns
from pdserve.engine.sequence import Sequence
from pdserve.protocol.prefix_hash import hash_block, prefix_hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks}x{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._reused = [False] * num_blocks  # keyed and served a prefix hit since
        self._hash_to_block: dict[bytes, int] = {}
        self._free = FreeRuns(num_blocks)  # never keyed: taken before any cached block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced; oldest first
        self._seq_hashes: dict[str, list[bytes]] = {}  # keys of each sequence's full blocks so far
        self.prefix_hits = 0  # blocks served from the prefix cache, for metrics
        # Its keys as they come and go, for the routers' prefix index; None without a prefix cache.
        self.journal = PrefixCacheJournal(max_removed=4 * num_blocks) if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now, cached ones included (they are evicted on demand)."""
        return self._free.count + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live sequences or transfers."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks kept only by the prefix cache."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def holds_free_run(self, count: int) -> bool:
        """Whether one run of never-keyed free blocks holds `count`: an allocation of them evicts no cached block."""
        return 0 < count <= self._free.count and self._free.best_fit(count)[1] >= count

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the sequence's leading tokens. At least one token is always left to
        compute, because the last one's logits are what the next token is sampled from."""
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        n = seq.num_tokens - 1
        if seq.prefix_keys is None or seq.prefix_keys[0] != n:
            seq.prefix_keys = (n, prefix_hashes(seq.token_slice(0, n), self.block_size, seq.cache_salt))
        for key in seq.prefix_keys[1]:
            block = self._hash_to_block.get(key)
            if block is None:
                break
            matched.append(block)
        return matched

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, prefix_blocks: Seq[int] = ()) -> bool:
        """Grow the block table to hold `prefix_blocks` (shared) then `num_new_tokens` more tokens past
        `seq.num_computed_tokens`. All or nothing: False and no change when the pool is too small."""
        held = len(seq.block_table) + len(prefix_blocks)
        covered = seq.num_computed_tokens + len(prefix_blocks) * self.block_size + num_new_tokens
        needed = max(0, self.blocks_for(covered) - held)
        revived = sum(1 for b in prefix_blocks if self._ref_counts[b] == 0)
        if needed + revived > self.num_free_blocks:
            return False
        hits = not seq.num_preemptions  # a recompute finding its own freed blocks is no prefix-cache hit
        for block in prefix_blocks:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            self._reused[block] |= hits
        self.prefix_hits += len(prefix_blocks) * hits
        seq.block_table.extend(prefix_blocks)
        if needed:
            # A prompt computed in chunks takes its first blocks where the whole prompt fits, so later chunks
            # continue the run.
            whole = max(needed, self.blocks_for(seq.num_tokens) - held)
            after = seq.block_table[-1] if seq.block_table else None
            seq.block_table.extend(self._take_blocks(needed, after, whole))
        return True

    def _take_blocks(self, count: int, after: int | None, room: int) -> list[int]:
        """`count` blocks, in runs where the pool allows; `room` >= count is what the table will grow to.

        Each step runs only while the ones before it did not give `count`: the free blocks right after `after`
        (the table's run goes on); a free run that holds `room` (best fit); a run through the cache
        (`_run_through_cache`); last, free runs, longest first."""
        want = max(room, count)
        taken = [] if after is None else self._free_from(after + 1, count)
        if len(taken) < count:
            taken += self._free_run_holding(count - len(taken), want - len(taken))
        if len(taken) < count:
            taken += self._run_through_cache(count - len(taken), want - len(taken))
        if len(taken) < count:
            taken += self._longest_free_runs(count - len(taken))
        for block in taken:
            self._ref_counts[block] = 1
        return taken

    def _free_from(self, block: int, most: int) -> list[int]:
        """The free blocks from `block` up to the first used one, at most `most`: taken."""
        run: list[int] = []
        while len(run) < most and block + len(run) < self.num_blocks and block + len(run) in self._free:
            run.append(block + len(run))
        self._free.take(run)
        return run

    def _free_run_holding(self, count: int, room: int) -> list[int]:
        """The first `count` blocks of the shortest free run that holds `room` (the table grows on into the rest),
        taken; none when no free run holds it."""
        if not self._free.count:
            return []
        start, length = self._free.best_fit(room)
        if length < room:
            return []
        run = list(range(start, start + count))
        self._free.take(run)
        return run

    def _run_through_cache(self, count: int, room: int) -> list[int]:
        """`count` blocks, fewer when the cache runs out, cut from cached blocks, oldest first, with the free blocks
        around them: from the free blocks just above the oldest cached block down through it and the blocks below
        (after a table was freed tail first, the next oldest), sorted. A cached block that served a prefix hit
        starts a run only when the free blocks cannot make up `count` without it, and stops any other run:
        contiguity (a KV transfer moves a run without a copy) may cost the cache blocks no request reused, never a
        hot prefix. Evicting `room` blocks, not just `count`, leaves the rest of that run free for the table's next
        chunk."""
        run: list[int] = []
        while len(run) < room:
            hot_too = self._free.count < count - len(run)
            oldest = next((b for b in self._evictable if hot_too or not self._reused[b]), None)
            if oldest is None:
                break
            run += self._free_from(oldest + 1, room - len(run))
            run += self._cold_down_from(oldest, room - len(run))
        run.sort()
        self._free.give(run[count:])
        return run[:count]

    def _cold_down_from(self, oldest: int, most: int) -> list[int]:
        """`oldest` (evicted) and the blocks below it down to the first used or hot one, at most `most`: taken, the
        cached ones evicted."""
        run: list[int] = []
        block = oldest
        while len(run) < most and block >= 0:
            if block in self._evictable and (block == oldest or not self._reused[block]):
                self._evict(block)
            elif block in self._free:
                self._free.take([block])
            else:
                break
            run.append(block)
            block -= 1
        return run

    def _longest_free_runs(self, count: int) -> list[int]:
        """`count` blocks from the free runs, longest first: the pool holds them, but in no one run."""
        taken: list[int] = []
        while len(taken) < count:
            start, length = self._free.best_fit(count - len(taken))
            run = list(range(start, start + min(length, count - len(taken))))
            self._free.take(run)
            taken.extend(run)
        return taken

    def _evict(self, block: int) -> None:
        del self._evictable[block]
        key = self._block_hash[block]
        self._block_hash[block] = None
        self._reused[block] = False
        if key is not None and self._hash_to_block.get(key) == block:
            del self._hash_to_block[key]
            if self.journal is not None:
                self.journal.evicted(key)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the sequence's blocks that became full of computed tokens, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            tokens = seq.token_slice(i * self.block_size, (i + 1) * self.block_size)
            key = hash_block(hashes[-1] if hashes else seq.cache_salt, tokens)
            hashes.append(key)
            block = seq.block_table[i]
            if self._block_hash[block] is None and key not in self._hash_to_block:
                self._block_hash[block] = key
                self._hash_to_block[key] = block
                if self.journal is not None:
                    self.journal.stored(key)

    def free(self, seq: Sequence) -> None:
        """Return every block the sequence holds. Tail blocks go first, so eviction takes them before
        the shared prefix blocks in front of them."""
        unkeyed = []
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    unkeyed.append(block)
        self._free.give(unkeyed)
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)

    def block_hashes(self) -> list[bytes]:
        """Keys of every block in the prefix cache, live or evictable: what a router may index."""
        return list(self._hash_to_block)
