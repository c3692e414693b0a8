"""Paged KV block manager: a free list and one block table per request.

The KV cache is cut into blocks of ``block_size`` token slots (PagedAttention, Kwon et al.,
SOSP 2023). A request's block table lists the blocks holding its tokens in order, so token
position ``p`` lives in slot ``table[p // block_size] * block_size + p % block_size``.
Accounting is exact: ``num_used_blocks + num_free_blocks == num_blocks`` always, and the used
blocks are exactly those in some block table. No torch here: the scheduler decides with it.
"""

from __future__ import annotations

from collections import deque


class KVBlockManager:
    """Allocates KV blocks to requests.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so the request's table holds ``num_tokens`` tokens (0 if it already does)."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def capacity(self, request_id: str) -> int:
        """Tokens the request could hold now: its own blocks plus every free block."""
        have = len(self.block_tables.get(request_id, ()))
        return (have + len(self._free)) * self.block_size

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """True when the request's table can grow to hold ``num_tokens`` tokens."""
        return self.num_blocks_needed(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold ``num_tokens`` tokens; return the new block ids.

        Raises:
            MemoryError: not enough free blocks (check ``can_allocate`` first); nothing changes.
        """
        needed = self.num_blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            raise MemoryError(f"request {request_id} needs {needed} KV blocks, {len(self._free)} free")
        table = self.block_tables.setdefault(request_id, [])
        new = [self._free.popleft() for _ in range(needed)]
        table.extend(new)
        return new

    def append_slot(self, request_id: str, num_tokens: int) -> bool:
        """Fast path for a decode: make room for token ``num_tokens - 1``; False if no block is free."""
        table = self.block_tables[request_id]
        if num_tokens <= len(table) * self.block_size:
            return True
        if not self._free:
            return False
        table.append(self._free.popleft())
        return True

    def free(self, request_id: str) -> int:
        """Return all of the request's blocks to the free list; the number freed (0 if none)."""
        table = self.block_tables.pop(request_id, None)
        if not table:
            return 0
        self._free.extend(table)
        return len(table)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty if it holds none)."""
        return self.block_tables.get(request_id, [])
