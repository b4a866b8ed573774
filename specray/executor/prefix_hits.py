"""The scheduler's use of the prefix cache (kv/prefix_cache.py): hits at admission, publishing
after each step, reset. A mixin of ``Scheduler`` (scheduler.py), which owns the state it reads.

Prefix caching (``prefix_pools`` given, kv/prefix_cache.py): on admission the request's
prompt (its tokens so far, after a preemption) is looked up in every pool at once and the
hit is one token count for all of them (``shared_hit_length``); the hit pages join the block
tables, ``num_computed`` starts there and the plan carries the cached tokens
(``cached_prefix``) so the ranks' drafters start from them. The first step after a hit is a
prefill row even when it computes a single token, as the cold run's first step is. After
every step each pool publishes its pages that hold only verified KV: the target pool below
``num_computed`` (and, when a one-model drafter's layers live in it, below what the drafter
has consumed), a standalone drafter's pool below what it has consumed
(``num_draft_valid``). Freed pages (finish, abort, preemption, rollback) go back through the
allocator, which keeps the published ones cached.

A drafter catches up on the positions it has not consumed when it next drafts. A row that does
not draft (a prompt's last chunk; adaptive length 0, for as long as it lasts) would then publish
no page the drafter's KV shares, and a request would never hit its own prompt again: so when such
a row's verified positions after the step reach a page the drafter has not covered, the plan
names it (``catch_up``) and every rank's drafter writes its KV there after the step, all but the
last position (the next draft's first forward starts from it): once a page, the same work it
would do at its next draft, done earlier.
"""

from __future__ import annotations

from specray.kv.prefix_cache import find_hit

# ``Sequence`` in the annotations is scheduler.py's (not imported: that module imports this one)


class PrefixHits:
    def _find_hit(self, seq: Sequence) -> tuple[int, list[list[int]], list[list]]:
        if not self.prefix_pools:
            return 0, [[]], [[]]
        if seq.params.prompt_logprobs is not None:  # its whole prompt runs for its log-probabilities (as vLLM)
            return 0, [[] for _ in self.prefix_pools], [[] for _ in self.prefix_pools]
        return find_hit(self.prefix_pools, seq.token_ids, seq.cache_salt)

    def _take_hit(self, seq: Sequence, hit: int, pages: list[list[int]], keys: list[list]) -> None:
        """The hit pages start the block tables; the drafter's cache starts there too."""
        for pool, p in zip(self.prefix_pools, pages):
            pool.allocator.acquire(p)
            pool.num_query_tokens += len(seq.token_ids)
            pool.num_hit_tokens += hit
        seq.page_keys = keys if self.prefix_pools else []
        if not self.prefix_pools:
            return
        seq.block_table = list(pages[0])
        if self.draft_allocator is not None:
            seq.draft_block_table = list(pages[1])
        seq.num_computed = seq.num_draft_valid = seq.num_hit_unsent = hit
        seq.is_prefilling = hit > 0
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit

    def _publish(self, seq: Sequence) -> None:
        """Publish each pool's pages that now hold only verified KV (module docstring)."""
        if not self.prefix_pools:
            return
        valid = [seq.num_computed if self.drafter_kv != "target" else min(seq.num_computed, seq.num_draft_valid)]
        tables = [seq.block_table]
        if self.draft_allocator is not None:
            valid.append(seq.num_draft_valid)
            tables.append(seq.draft_block_table)
        seq.page_keys = [pool.publish(table, keys, seq.token_ids, n, seq.cache_salt) for pool, table, keys, n
                         in zip(self.prefix_pools, tables, seq.page_keys or [[]] * len(tables), valid)]

    def _catches_up(self, seq: Sequence, is_partial: bool) -> bool:
        """Whether the drafter catches up after this step on the row's verified positions but the
        last (module docstring): it drafts nothing, samples, and that reaches a page past what
        the drafter holds."""
        if not self.prefix_pools or self.drafter_kv is None or seq.num_drafts_fed or is_partial:
            return False
        page = self.tokens_per_block if self.drafter_kv == "target" else self.draft_tokens_per_block
        return (len(seq.token_ids) - 1) // page > seq.num_draft_valid // page

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (keys dropped; pages in use stay with their requests and are
        published again as they run). Returns the keys dropped over every pool."""
        for seq in self.running:
            seq.page_keys = []
        return sum(pool.allocator.reset() for pool in self.prefix_pools)
