"""Paged KV block pool, depth-aware: a request owns one block table per loop plane.

A block holds `block_size` token slots of K and V for every layer of ONE plane. With the
LAST_EXITED layout there is one plane per loop depth. Reservation is for the request's whole
lifetime at admission, so a running request can never run out of pages.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_planes: int) -> None:
        self.num_blocks, self.block_size, self.num_planes = num_blocks, block_size, num_planes
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[list[int]]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.num_planes * -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    def allocate(self, owner: str, num_tokens: int) -> list[list[int]]:
        if owner in self._tables:
            raise RuntimeError(f"{owner} already holds KV blocks")
        if not self.can_allocate(num_tokens):
            raise RuntimeError(f"out of KV blocks for {owner}")
        per_plane = -(-num_tokens // self.block_size)
        tables = [[self._free.popleft() for _ in range(per_plane)] for _ in range(self.num_planes)]
        self._tables[owner] = tables
        return tables

    def free(self, owner: str) -> None:
        for table in self._tables.pop(owner, []):
            self._free.extend(table)

    def slot(self, table: list[int], position: int) -> int:
        """Flat slot index of `position` in a plane's block table."""
        return table[position // self.block_size] * self.block_size + position % self.block_size
