"""Prefix cache: full pages addressed by content, refcounted, evicted LRU with tails first.

Plain Python, no torch: rank 0's scheduler owns one per pool (the target's, a standalone
drafter's own at its own page size) and the ranks only see the block ids it puts in plans.

A page's key is a chained hash: (its parent page's key, the page's tokens, and extras: the
request's ``cache_salt`` in the first page; with ``successor_tokens`` s > 0 also the s tokens
after the page, for pools whose KV at a position depends on the next token — EAGLE-3's and
MTP's layers pair position p with token p + 1). Equal keys therefore mean equal KV.

A page is in one of three states:
- in use: refcount > 0 (held by one or more sequences' block tables); never evicted;
- cached free: refcount 0 but still published; it counts as free and sits in an LRU queue;
  an allocation takes never-published pages first, then evicts from the queue's head;
- free: refcount 0, unpublished.

Tails first: a sequence frees its pages tail first, so in the queue a page always comes
before its parent (a sequence that holds a page holds its whole chain, hence the parent's
refcount is at least the child's); evicting from the head never strands a cached page whose
parent key is gone (the property tests check it). Several pages may hold one key (two
requests computed the same prefix at once): a lookup takes the first.

The scheduler publishes a page only once every slot of it holds verified tokens' KV in
every layer that lives in the pool (never a draft slot): see ``executor/scheduler.py``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from specray.kv.allocator import OutOfBlocks

PageKey = bytes


def page_key(parent: PageKey | None, tokens: list[int], extra: str | None) -> PageKey:
    """The chained content hash of one page (``parent`` None: the first page)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"root")
    h.update(array("q", tokens).tobytes())
    if extra is not None:
        h.update(b"\x00salt" + extra.encode())
    return h.digest()


def extend_keys(keys: list[PageKey], tokens: list[int], page_size: int, num_tokens: int, *,
                salt: str | None = None, successor_tokens: int = 0) -> list[PageKey]:
    """``keys`` extended with the key of every further page wholly below ``num_tokens`` whose
    successor tokens exist in ``tokens`` (returns a new list)."""
    out = list(keys)
    limit = min(num_tokens, len(tokens) - successor_tokens)
    while (len(out) + 1) * page_size <= limit:
        i = len(out)
        page = tokens[i * page_size:(i + 1) * page_size + successor_tokens]
        out.append(page_key(out[-1] if out else None, page, salt if i == 0 else None))
    return out


class PrefixCachingAllocator:
    """The block allocator of one pool with its prefix cache (``BlockAllocator``'s interface)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # unpublished; lowest ids go first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # published, refcount 0: LRU first
        self._refs = [0] * num_blocks
        self._key_of: list[PageKey | None] = [None] * num_blocks
        self._parent_of: list[PageKey | None] = [None] * num_blocks
        self._by_key: dict[PageKey, dict[int, None]] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: never published or cached free (evicted on demand)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    @property
    def num_published(self) -> int:
        return sum(len(blocks) for blocks in self._by_key.values())

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def key_of(self, block: int) -> PageKey | None:
        return self._key_of[block]

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} pages, {self.num_free} free")
        blocks = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def _evict(self) -> int:
        block, _ = self._cached_free.popitem(last=False)
        self._unpublish(block)
        self.num_evictions += 1
        return block

    def _unpublish(self, block: int) -> None:
        key = self._key_of[block]
        holders = self._by_key[key]
        del holders[block]
        if not holders:
            del self._by_key[key]
        self._key_of[block] = self._parent_of[block] = None

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each page; a page nobody holds becomes free, or cached free
        when published (tail first: the queue then evicts a chain's tail before its root)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"page {b} freed twice")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0 and self._key_of[b] is not None:
                self._cached_free[b] = None
        for b in blocks:
            if self._refs[b] == 0 and self._key_of[b] is None:
                self._free.append(b)

    def lookup(self, keys: list[PageKey]) -> list[int]:
        """The cached pages of the longest prefix of ``keys`` (changes nothing)."""
        hits = []
        for key in keys:
            holders = self._by_key.get(key)
            if not holders:
                break
            hits.append(next(iter(holders)))
        return hits

    def num_to_revive(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached free: acquiring them takes that many free pages."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference to cached pages (a prefix hit)."""
        for b in blocks:
            if self._key_of[b] is None:
                raise RuntimeError(f"page {b} is not cached: only published pages can be shared")
            if self._refs[b] == 0:
                del self._cached_free[b]
            self._refs[b] += 1

    def publish(self, block: int, key: PageKey, parent: PageKey | None) -> None:
        """Make a full page of verified tokens findable by ``key``."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"page {block} is free: only a page in use can be published")
        if self._key_of[block] is not None:
            if self._key_of[block] != key:
                raise RuntimeError(f"page {block} is already published under another key")
            return
        self._key_of[block], self._parent_of[block] = key, parent
        self._by_key.setdefault(key, {})[block] = None

    def reset(self) -> int:
        """Forget every key (``POST /reset_prefix_cache``): cached free pages become plain free
        pages; pages in use stay with their sequences, unpublished. Returns the keys dropped."""
        num_keys = len(self._by_key)
        for block in list(self._cached_free):
            self._unpublish(block)
            self._free.append(block)
        self._cached_free.clear()
        for block in range(self.num_blocks):
            if self._key_of[block] is not None:
                self._unpublish(block)
        return num_keys

    def check_invariants(self) -> None:
        """For tests: the counts add up, nothing in use is queued, every cached page's parent
        key is still cached (tails are evicted before roots)."""
        in_use = sum(1 for r in self._refs if r > 0)
        if len(self._free) + len(self._cached_free) + in_use != self.num_blocks:
            raise AssertionError(f"free {len(self._free)} + cached free {len(self._cached_free)} + in use "
                                 f"{in_use} != {self.num_blocks}")
        for b in self._cached_free:
            if self._refs[b] != 0 or self._key_of[b] is None:
                raise AssertionError(f"page {b} queued with refcount {self._refs[b]}, key {self._key_of[b]}")
        for b in self._free:
            if self._refs[b] != 0 or self._key_of[b] is not None:
                raise AssertionError(f"free page {b} has refcount {self._refs[b]} or a key")
        for b, parent in enumerate(self._parent_of):
            if parent is not None and parent not in self._by_key:
                raise AssertionError(f"page {b} is cached but its parent key was evicted")


def shared_hit_length(num_tokens: int, matched: list[tuple[int, int]]) -> int:
    """The one hit every pool of a request uses: the shortest match over the pools
    (``matched``: (cached pages, page size) per pool), at most ``num_tokens - 1`` (one token
    is always computed, for its logits), rounded down to a multiple of every page size
    (the pages are powers of two: the largest is their lcm)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens ({num_tokens}) must be >= 1")
    unit = max(page for _, page in matched)
    hit = min([num_tokens - 1] + [pages * page for pages, page in matched])
    return hit // unit * unit


class CachedPool:
    """One pool's cache as a request sees it: its allocator, page size and key rule."""

    def __init__(self, name: str, allocator: PrefixCachingAllocator, page_size: int, successor_tokens: int = 0):
        self.name, self.allocator, self.page_size = name, allocator, page_size
        self.successor_tokens = successor_tokens
        self.num_query_tokens = 0  # Prometheus prefix_cache_queries_total (tokens looked up)
        self.num_hit_tokens = 0  # prefix_cache_hits_total (tokens served from the cache)

    def keys(self, tokens: list[int], num_tokens: int, salt: str | None, known: list[PageKey] = ()) -> list[PageKey]:
        return extend_keys(list(known), tokens, self.page_size, num_tokens, salt=salt,
                           successor_tokens=self.successor_tokens)

    def publish(self, table: list[int], known: list[PageKey], tokens: list[int], num_valid: int,
                salt: str | None) -> list[PageKey]:
        """Publish every page of ``table`` wholly below ``num_valid`` not yet published;
        returns the keys of the published prefix."""
        keys = self.keys(tokens, num_valid, salt, known)
        for i in range(len(known), len(keys)):
            self.allocator.publish(table[i], keys[i], keys[i - 1] if i else None)
        return keys


def find_hit(pools: list[CachedPool], tokens: list[int], salt: str | None) -> tuple[int, list[list[int]], list[list[PageKey]]]:
    """(hit tokens, the hit pages of each pool, their keys) for a request of ``tokens``."""
    keys = [pool.keys(tokens, len(tokens) - 1, salt) for pool in pools]
    matched = [pool.allocator.lookup(k) for pool, k in zip(pools, keys)]
    hit = shared_hit_length(len(tokens), [(len(m), pool.page_size) for pool, m in zip(pools, matched)])
    pages = [m[:hit // pool.page_size] for pool, m in zip(pools, matched)]
    return hit, pages, [k[:len(p)] for k, p in zip(keys, pages)]
