"""Paged KV block pool, depth-aware: a request owns one block table per loop plane.

A block holds `block_size` token slots of K and V for every layer of ONE plane. LAST_EXITED
has one plane per loop depth, SHARED a single plane. Tables of all planes always grow together.

Prefix reuse (LAST_EXITED): a full prompt block that does not hold the prompt's last token is
identified by (its parent's id, its token ids) — exact, no hash collisions — and maps to one
physical block per plane. Cached blocks are reference counted; unreferenced ones stay cached
in LRU order and are evicted only when an allocation can succeed with them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

_ROOT = 0  # parent id of a prompt's first block


_Key = tuple[int, tuple[int, ...]]  # (parent entry id, token ids of the block)


@dataclass
class _CachedBlock:
    entry_id: int
    key: _Key
    blocks: tuple[int, ...]  # one physical block per plane
    refs: int = 0


@dataclass
class PrefixStats:
    queried_blocks: int = 0
    hit_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, num_planes: int, prefix_caching: bool = False
    ) -> None:
        self.num_blocks, self.block_size, self.num_planes = num_blocks, block_size, num_planes
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[list[int]]] = {}
        self._held: dict[str, list[_CachedBlock]] = {}  # cached prefix blocks an owner uses
        self._cache: dict[_Key, _CachedBlock] = {}
        self._lru: OrderedDict[int, _CachedBlock] = OrderedDict()  # unreferenced, oldest first
        self._next_entry = 1
        self.stats = PrefixStats()

    # -- capacity ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return len(self._free) + self.num_planes * len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks that hold live requests' KV (cached-but-unreferenced blocks count as free)."""
        return self.num_blocks - self.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return self.num_planes * -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free

    def capacity(self, owner: str) -> int:
        """Token positions the owner's tables cover."""
        tables = self._tables.get(owner)
        return len(tables[0]) * self.block_size if tables else 0

    def blocks_to_grow(self, owner: str, num_tokens: int) -> int:
        have = self.num_planes * (self.capacity(owner) // self.block_size)
        return max(0, self.blocks_needed(num_tokens) - have)

    # -- allocation ----------------------------------------------------------------------
    def allocate(
        self, owner: str, num_tokens: int, prompt: list[int] | None = None
    ) -> tuple[list[list[int]], int]:
        """Tables covering `num_tokens` positions; reuses cached prompt blocks when enabled.
        Returns (tables, number of leading prompt tokens whose KV is already cached)."""
        if owner in self._tables:
            raise RuntimeError(f"{owner} already holds KV blocks")
        hits = self._lookup(prompt) if self.prefix_caching and prompt else []
        per_plane = -(-num_tokens // self.block_size)
        fresh = self.num_planes * max(0, per_plane - len(hits))
        if fresh > len(self._free) + self.num_planes * (len(self._lru) - self._lru_hits(hits)):
            raise RuntimeError(f"out of KV blocks for {owner}")
        if prompt and self.prefix_caching:  # count claims that happen, not attempts
            self.stats.queried_blocks += len(self._prompt_blocks(prompt))
            self.stats.hit_blocks += len(hits)
        for entry in hits:
            if entry.refs == 0:
                del self._lru[entry.entry_id]
            entry.refs += 1
        tables = [[e.blocks[p] for e in hits] for p in range(self.num_planes)]
        for table in tables:
            table.extend(self._take(per_plane - len(hits)))
        self._tables[owner], self._held[owner] = tables, hits
        return tables, len(hits) * self.block_size

    def grow(self, owner: str, num_tokens: int) -> bool:
        """Extend the owner's tables (all planes) to cover `num_tokens` positions."""
        need = self.blocks_to_grow(owner, num_tokens)
        if need == 0:
            return True  # most calls: a decode row inside its last block
        if need > self.num_free:
            return False
        for table in self._tables[owner]:
            table.extend(self._take(need // self.num_planes))
        return True

    def _take(self, n: int) -> list[int]:
        while len(self._free) < n:
            self._evict_one()
        return [self._free.popleft() for _ in range(n)]

    def _evict_one(self) -> None:
        _, entry = self._lru.popitem(last=False)
        del self._cache[entry.key]
        self._free.extend(entry.blocks)

    def free(self, owner: str) -> None:
        held = self._held.pop(owner, [])
        held_blocks = {b for e in held for b in e.blocks}
        for entry in held:
            entry.refs -= 1
            if entry.refs == 0:
                self._lru[entry.entry_id] = entry
        for table in self._tables.pop(owner, []):
            self._free.extend(b for b in table if b not in held_blocks)

    def owned_blocks(self, owner: str) -> list[list[int]]:
        return [list(t) for t in self._tables.get(owner, [])]

    def slot(self, table: list[int], position: int) -> int:
        """Flat slot index of `position` in a plane's block table."""
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # -- prefix cache --------------------------------------------------------------------
    def _prompt_blocks(self, prompt: list[int]) -> list[tuple[int, ...]]:
        """Full prompt blocks that do not hold the last prompt token (its hidden is needed)."""
        bs = self.block_size
        return [tuple(prompt[i : i + bs]) for i in range(0, len(prompt) - 1 - bs + 1, bs)]

    def _lookup(self, prompt: list[int]) -> list[_CachedBlock]:
        hits, parent = [], _ROOT
        for tokens in self._prompt_blocks(prompt):
            entry = self._cache.get((parent, tokens))
            if entry is None:
                break
            hits.append(entry)
            parent = entry.entry_id
        return hits

    def _lru_hits(self, hits: list[_CachedBlock]) -> int:
        return sum(1 for e in hits if e.refs == 0)

    def commit_prefix(self, owner: str, prompt: list[int], num_done: int) -> None:
        """Publish the owner's prompt blocks whose positions are final on every plane."""
        if not self.prefix_caching or owner not in self._tables:
            return
        held, tables = self._held[owner], self._tables[owner]
        parent = held[-1].entry_id if held else _ROOT
        for index, tokens in enumerate(self._prompt_blocks(prompt)):
            if index < len(held):
                continue
            if (index + 1) * self.block_size > num_done:
                break
            key = (parent, tokens)
            if key in self._cache:  # another request published the same block first
                break
            entry = _CachedBlock(self._next_entry, key, tuple(t[index] for t in tables), refs=1)
            self._next_entry += 1
            self._cache[key] = entry
            held.append(entry)
            parent = entry.entry_id
