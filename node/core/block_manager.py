"""Paged KV block manager with prefix caching: ref-counted blocks, a hash map, LRU eviction.

The KV cache is cut into blocks of ``block_size`` token slots (PagedAttention, Kwon et al.,
SOSP 2023). A request's block table lists its blocks in token order, so position ``p`` lives in
slot ``table[p // block_size] * block_size + p % block_size``.

Prefix caching (as vLLM's automatic prefix caching): a *full* block is identified by a hash
chained over every token id of the prefix up to its end, so equal hashes mean equal KV. The hash
is SHA-256 over the parent block's hash and the block's token ids (as 32-bit words), truncated to
128 bits: a crafted prompt cannot collide with another's blocks and be handed their KV, as it
could with Python's 64-bit unsalted ``hash()`` (vLLM's CVE-2025-25183). The chain starts from a
root derived from a per-request *salt*: requests with different salts never share blocks, so a
tenant cannot probe another tenant's prompts through time to first token. Blocks
are ref-counted; a new request adopts the cached blocks of its longest cached prefix and computes
only the rest. A block whose last user finishes keeps its hash and stays cached-but-free; it is
evicted, least recently freed first, only when a fresh block is needed. Hashes are registered
only after the step that wrote the block's KV (:meth:`commit`), so a block is never offered for
reuse before its KV exists.

Accounting is exact: ``num_used_blocks`` (ref > 0) + ``num_cached_free_blocks`` +
``num_plain_free_blocks`` == ``num_blocks``. The manager also owns the *reservation* of admitted
prompts: blocks a prompt still needs to finish its prefill are counted at admission
(:meth:`KVBlockManager.admit`) and used up as its chunks allocate them, so a new admission sees
``headroom`` net of what others already have a claim on. No torch here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType

HASH_BYTES = 16  # SHA-256 truncated to 128 bits
_ROOT_HASH = hashlib.sha256(b"cadenza-prefix-cache-v2").digest()[:HASH_BYTES]


def root_hash(salt: bytes = b"") -> bytes:
    """The chain's start for requests with cache salt ``salt`` (no salt: the shared root)."""
    return _ROOT_HASH if not salt else hashlib.sha256(_ROOT_HASH + salt).digest()[:HASH_BYTES]


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block holding ``token_ids`` after the prefix hashed ``parent``."""
    return hashlib.sha256(parent + array("I", token_ids).tobytes()).digest()[:HASH_BYTES]


class KVBlockManager:
    """Allocates KV blocks to requests; the scheduler's only view of KV memory.

    The API is narrow: grow a request's table to hold ``n`` tokens or say no
    (:meth:`allocate_slots`), admit a request with its prefix-cache hit and a reservation for the
    rest of its prompt (:meth:`admit`), register computed blocks (:meth:`commit`), free
    (:meth:`free`). Ref counts and the hash map stay inside; block tables are readable through
    the read-only ``tables`` view (the decode loop's per-row lookup) and :meth:`block_table`.

    Invariants (:meth:`consistent`): every block is used (ref > 0), cached-but-free or plain free,
    exactly once; a block's ref count is the number of tables holding it; the reserved total is
    the sum of what admitted prompts still need beyond their tables.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        prefix_caching: share the KV of identical prompt prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._tables: dict[str, list[int]] = {}
        self.tables: Mapping[str, list[int]] = MappingProxyType(self._tables)  # read-only view (hot path)
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block holding that prefix's KV
        self._plain_free: deque[int] = deque(range(num_blocks))  # free, never hashed (or evicted)
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free, hashed; oldest first
        self._hashes: dict[str, list[bytes]] = {}  # request -> chained hashes of its full blocks
        self._committed: dict[str, int] = {}  # request -> leading blocks of its table already committed
        self._reserved: dict[str, int] = {}  # request -> blocks its admitted prompt still needs
        self.num_reserved_blocks = 0  # sum of _reserved
        self.num_evictions = 0

    # -- accounting -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: plain free plus cached-but-free (evictable)."""
        return len(self._plain_free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_plain_free_blocks(self) -> int:
        return len(self._plain_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def holds(self, request_id: str) -> bool:
        """True while the request has a table (it was allocated or admitted and not freed)."""
        return request_id in self._tables

    def capacity(self, request_id: str) -> int:
        """Tokens the request could hold now: its own blocks plus every allocatable block."""
        return (self.num_blocks_held(request_id) + self.num_free_blocks) * self.block_size

    def headroom(self, cached: Sequence[int]) -> int:
        """Blocks a new admission whose prefix hit is ``cached`` may take now: the free ones,
        less those of its own hit (adopted, not allocated) and those reserved for admitted
        prompts."""
        refs = self._refs
        evictable = sum(1 for b in cached if refs[b] == 0)
        return self.num_free_blocks - evictable - self.num_reserved_blocks

    def reclaimable(self, request_id: str, keep: Collection[int] = ()) -> int:
        """Blocks that freeing the request would give back: those it alone holds (less any in
        ``keep``, e.g. a newcomer's prefix hit) plus its reservation."""
        refs = self._refs
        table = self._tables.get(request_id, ())
        return sum(1 for b in table if refs[b] == 1 and b not in keep) + self._reserved.get(request_id, 0)

    # -- allocation --------------------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens; False, changing nothing, when
        too few blocks are free. New blocks come out of the request's reservation first."""
        table = self._tables.get(request_id)
        have = 0 if table is None else len(table)
        needed = -(-num_tokens // self.block_size) - have
        if needed <= 0:
            if table is None:
                self._tables[request_id] = []
            return True
        if needed > len(self._plain_free) + len(self._cached_free):
            return False
        if table is None:
            table = self._tables[request_id] = []
        take = self._take
        for _ in range(needed):
            table.append(take())
        reserved = self._reserved.get(request_id)
        if reserved:
            used = min(reserved, needed)
            self._reserved[request_id] = reserved - used
            self.num_reserved_blocks -= used
        return True

    def _take(self) -> int:
        if self._plain_free:
            block = self._plain_free.popleft()
        else:  # evict the least recently freed cached block
            block, _ = self._cached_free.popitem(last=False)
            h = self._hash_of[block]
            if self._cached.get(h) == block:  # type: ignore[arg-type]
                del self._cached[h]  # type: ignore[arg-type]
            self._hash_of[block] = None
            self.num_evictions += 1
        self._refs[block] = 1
        return block

    def admit(self, request_id: str, cached: Sequence[int], num_tokens: int) -> None:
        """Start the request's table with its prefix hit ``cached`` (shared blocks, one more
        reference each) and reserve the blocks the rest of its ``num_tokens`` will need.

        Raises:
            ValueError: the request already holds blocks.
        """
        if self._tables.get(request_id):
            raise ValueError(f"request {request_id} already holds blocks")
        refs = self._refs
        for block in cached:
            if refs[block] == 0:
                del self._cached_free[block]
            refs[block] += 1
        self._tables[request_id] = list(cached)
        reserve = max(0, self.blocks_for(num_tokens) - len(cached))
        if reserve:
            self._reserved[request_id] = reserve
            self.num_reserved_blocks += reserve

    def share(self, holder_id: str, blocks: Sequence[int]) -> None:
        """Append ``blocks``, each in use, to ``holder_id``'s table with one more reference each,
        so they outlive the request that computed them until :meth:`free` of the holder (a prefill
        replica's lease on KV a decode replica pulls). ValueError for a block not in use."""
        refs = self._refs
        if any(refs[block] == 0 for block in blocks):
            raise ValueError(f"{holder_id}: can only share blocks in use")
        for block in blocks:
            refs[block] += 1
        self._tables.setdefault(holder_id, []).extend(blocks)

    def free(self, request_id: str, keep_hashes: bool = False) -> int:
        """Release the request's blocks and reservation; the number of blocks it held (0 if none).

        Blocks nobody else uses become free — cached-but-free if they hold a committed prefix
        (tail blocks first, so a prefix outlives its suffixes), plain free otherwise.
        ``keep_hashes`` keeps the request's memoised prefix hashes (a preempted request resumes
        with the same tokens).
        """
        if not keep_hashes:
            self._hashes.pop(request_id, None)
        self._committed.pop(request_id, None)
        self.num_reserved_blocks -= self._reserved.pop(request_id, 0)
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        refs = self._refs
        for block in reversed(table):
            refs[block] -= 1
            if refs[block] == 0:
                if self._hash_of[block] is not None:
                    self._cached_free[block] = None
                else:
                    self._plain_free.append(block)
        return len(table)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty if it holds none). The live list: the
        runner reads it, nobody outside this class changes it."""
        return self._tables.get(request_id, [])

    def consistent(self) -> bool:
        """Check the invariants (the class docstring); for tests and debugging: O(blocks)."""
        holders: dict[int, int] = {}
        for table in self._tables.values():
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        free = set(self._plain_free) | set(self._cached_free)
        return (all(self._refs[b] == n for b, n in holders.items())
                and all(self._refs[b] == 0 for b in range(self.num_blocks) if b not in holders)
                and not free & holders.keys()
                and len(free) + len(holders) == self.num_blocks
                and len(self._plain_free) + len(self._cached_free) == len(free)
                and self.num_reserved_blocks == sum(self._reserved.values()) >= 0)

    # -- prefix caching -----------------------------------------------------------------------------

    def match_prefix(self, request_id: str, token_ids: Sequence[int], salt: bytes = b"") -> list[int]:
        """Cached blocks holding the longest cached prefix of ``token_ids`` (not adopted yet).

        At most ``len(token_ids) - 1`` tokens are matched: the last token is always computed, so
        its logits exist, and it never lands in a shared block. Only blocks committed under the
        same ``salt`` match.
        """
        if not self.prefix_caching:
            return []
        hashes = self._chain(request_id, token_ids, (len(token_ids) - 1) // self.block_size, salt)
        blocks = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
               salt: bytes = b"") -> None:
        """Register the hashes of the request's blocks that are now full and computed."""
        if not self.prefix_caching:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        full = min(num_computed_tokens // self.block_size, len(table))
        done = self._committed.get(request_id, 0)
        if full <= done:
            return
        hashes = self._chain(request_id, token_ids, full, salt)
        hash_of, cached = self._hash_of, self._cached
        for i in range(done, full):
            block = table[i]
            if hash_of[block] is None and hashes[i] not in cached:
                hash_of[block] = hashes[i]
                cached[hashes[i]] = block
        self._committed[request_id] = full

    def _chain(self, request_id: str, token_ids: Sequence[int], num_full: int, salt: bytes) -> list[bytes]:
        """Chained hashes of the first ``num_full`` full blocks, memoised per request (a request's
        salt never changes while it is live)."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else root_hash(salt)
        for i in range(len(hashes), num_full):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes
