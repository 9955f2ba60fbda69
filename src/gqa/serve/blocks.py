"""The paged KV cache's bookkeeping: fixed-size blocks handed out to sequences, reference counts, and prefix caching.

The cache itself is one preallocated pool of ``num_blocks`` blocks of ``block_size`` token slots per layer (holding
the model's ``H_kv`` heads only); a sequence owns a *block table*, the list of block ids its tokens live in, in order.
``BlockManager`` decides which blocks those are. It never touches tensors.

Prefix caching: a *full* block is identified by a hash of its token ids chained with the hash of the block before it,
so equal hashes mean equal whole prefixes. A new sequence whose prompt starts with blocks already in the cache shares
them (their reference count goes up) and only the rest is computed; a chat template's system prompt is then read once.
A block whose last user leaves stays cached while it is free: it is reused for a new prefix hit, or reclaimed when
fresh blocks run out — least recently freed first, blocks no other sequence has read before those one has.

    manager = BlockManager(num_blocks=1024, block_size=16)
    table = manager.allocate(prompt_ids)      # BlockTable: .blocks, .cached_tokens (a prefix-cache hit)
    manager.computed(table, len(prompt_ids))  # after the step wrote their K/V: full blocks become shareable
    manager.append(table, next_id)            # one more token; a new block when the last one is full
    manager.release_before(table, position)   # a sliding window moved past its first blocks: they go back early
    manager.free(table)                       # blocks go back (full ones stay cached until reclaimed)
    block = manager.hold(block_hash)          # one more reference to a cached block while it is read elsewhere
    manager.release(block)                    # (written to disk)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["BlockManager", "BlockTable", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """No free block is left: the scheduler preempts a sequence (recomputed later) or waits."""


@dataclass
class BlockTable:
    """One sequence's blocks in order, its tokens, and how many leading tokens came from the prefix cache."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)  # chained hash of each full block, in order
    released: int = 0  # leading blocks given back already (no window reaches them); their ids stay, never read

    def slot(self, position: int, block_size: int) -> tuple[int, int]:
        """``(block id, offset)`` of token ``position``."""
        return self.blocks[position // block_size], position % block_size


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The identity of a full block: its token ids and everything before it (through ``parent``)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return digest.digest()


class BlockManager:
    """Hands out ``num_blocks`` blocks of ``block_size`` slots; counts references; caches full blocks by prefix."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self._fresh = list(range(num_blocks - 1, -1, -1))  # never used or reclaimed: popped from the end
        self._cached: dict[bytes, int] = {}  # full block hash -> block id
        self._hash_of: dict[int, bytes] = {}  # block id -> its hash, for blocks in _cached
        # Cached blocks nobody uses, least recently freed first, in two tiers: those never shared since they were
        # computed (a prompt's own text, most of which no request will ask for) are reclaimed before those another
        # sequence has read (a system prompt many requests share), so a burst of one-off prompts does not push a hot
        # prefix out (a segmented LRU; plain LRU made a replica recompute its shared prefixes: docs/performance.md).
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._idle_shared: OrderedDict[int, None] = OrderedDict()
        self._shared: set[int] = set()  # cached blocks read by a sequence other than the one that computed them
        # Lookups as vLLM counts them: a sequence's first allocation in prefix_*, one resumed after preemption (its
        # own blocks, computed before, are often still cached) in resumed_*, so a policy that preempts does not
        # read as a better hit rate.
        self.prefix_hits = 0  # blocks shared from the prefix cache since creation
        self.prefix_queries = 0  # full prompt blocks of the sequences allocated (each hit or computed)
        self.resumed_hits = 0
        self.resumed_queries = 0

    @property
    def num_free(self) -> int:
        """Blocks a new sequence can get: never used, or cached but unused (reclaimable)."""
        return len(self._fresh) + len(self._idle) + len(self._idle_shared)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, tokens: list[int], keep_free: int = 0, resumed: bool = False) -> BlockTable:
        """A table for a new sequence holding ``tokens`` (its prompt), sharing the cached blocks of its longest cached
        prefix of full blocks. At least the last prompt token is left uncached (its logits are needed), so a prompt of
        whole cached blocks recomputes its last block. Raises ``OutOfBlocks`` (and takes nothing) if the rest does not
        fit with ``keep_free`` blocks still free after it. ``resumed``: a preempted sequence taken up again (its
        lookup counted apart, in ``resumed_hits`` / ``resumed_queries``)."""
        if not tokens:
            raise ValueError("a sequence needs at least one token")
        size = self.block_size
        table = BlockTable(tokens=list(tokens))
        parent, shared = b"", []
        full = (len(tokens) - 1) // size  # full blocks before the last token
        for start in range(0, full * size, size):
            h = block_hash(parent, tokens[start : start + size])
            block = self._cached.get(h)
            if block is None:
                break
            shared.append((block, h))
            parent = h
        needed = self.blocks_needed(len(tokens)) - len(shared)
        idle = len(self._idle) + len(self._idle_shared)
        reclaimable = idle - sum(1 for block, _ in shared if block in self._idle or block in self._idle_shared)
        if needed + keep_free > len(self._fresh) + reclaimable:
            kept = f" ({keep_free} to keep free)" if keep_free else ""
            raise OutOfBlocks(f"{needed} blocks needed{kept}, {len(self._fresh) + reclaimable} free")
        for block, h in shared:
            self._take(block)
            self._shared.add(block)
            table.blocks.append(block)
            table.hashes.append(h)
        # counted once a sequence gets its blocks: a wait for room is not a lookup
        if resumed:
            self.resumed_hits += len(shared)
            self.resumed_queries += full
        else:
            self.prefix_hits += len(shared)
            self.prefix_queries += full
        table.cached_tokens = len(shared) * size
        for _ in range(needed):
            table.blocks.append(self._new_block())
        return table

    def append(self, table: BlockTable, token: int) -> None:
        """One more token for ``table``'s sequence: a new block when its last one is full (``OutOfBlocks`` if none
        is left; the table is then unchanged)."""
        if len(table.tokens) == len(table.blocks) * self.block_size:
            table.blocks.append(self._new_block())
        table.tokens.append(token)

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` slots in ``table``, new ones appended; ``OutOfBlocks`` when none is left (the
        table keeps the blocks it got)."""
        while len(table.blocks) * self.block_size < num_tokens:
            table.blocks.append(self._new_block())

    def free(self, table: BlockTable) -> None:
        """Gives ``table``'s blocks back (those not released before): unused cached blocks stay reusable until
        reclaimed."""
        for block in reversed(table.blocks[table.released :]):
            self._drop(block)
        table.blocks.clear()
        table.hashes.clear()
        table.released = 0

    def release_before(self, table: BlockTable, position: int) -> int:
        """Give back ``table``'s blocks that hold only slots before ``position``: no query of the sequence reads them
        again (every layer's sliding window starts at or after it). Their ids stay in the table, in place, for the
        kernels' block arithmetic; the blocks may serve other sequences now. Returns how many were given back."""
        end = min(max(position, 0) // self.block_size, len(table.blocks))
        first = table.released
        for i in range(first, end):
            self._drop(table.blocks[i])
        table.released = max(first, end)
        return table.released - first

    def hold(self, block_hash: bytes) -> int | None:
        """One more reference to the cached block with ``block_hash``, in use or idle: it is not reused until
        ``release`` (a block being written to disk, ``prefix_disk``). Its id, or None where no block has that hash
        (never cached, or reclaimed since)."""
        block = self._cached.get(block_hash)
        if block is not None:
            self._take(block)
        return block

    def release(self, block: int) -> None:
        """Give back a reference ``hold`` took."""
        self._drop(block)

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] < 0:
            raise RuntimeError(f"block {block} freed more often than taken")
        if self.refs[block] == 0:
            if block in self._hash_of:
                (self._idle_shared if block in self._shared else self._idle)[block] = None
            else:
                self._fresh.append(block)

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            self._idle.pop(block, None)
            self._idle_shared.pop(block, None)
        self.refs[block] += 1

    def _new_block(self) -> int:
        if self._fresh:
            block = self._fresh.pop()
        elif self._idle or self._idle_shared:  # reclaim the least recently freed cached block, never-shared ones first
            block, _ = (self._idle or self._idle_shared).popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
            self._shared.discard(block)
        else:
            raise OutOfBlocks("no free block")
        self.refs[block] = 1
        return block

    def computed(self, table: BlockTable, num_tokens: int) -> None:
        """The K/V of ``table``'s first ``num_tokens`` tokens are written: its full blocks among them enter the prefix
        cache (before that another sequence must not share them)."""
        if not 0 <= num_tokens <= len(table.tokens):
            raise ValueError(f"num_tokens must be in [0, {len(table.tokens)}], got {num_tokens}")
        size = self.block_size
        while (len(table.hashes) + 1) * size <= num_tokens:
            i = len(table.hashes)
            parent = table.hashes[-1] if table.hashes else b""
            h = block_hash(parent, table.tokens[i * size : (i + 1) * size])
            table.hashes.append(h)
            block = table.blocks[i]
            if h not in self._cached and block not in self._hash_of:
                self._cached[h] = block
                self._hash_of[block] = h
