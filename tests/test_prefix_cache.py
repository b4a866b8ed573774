"""The prefix cache (kv/prefix_cache.py) and the scheduler's use of it, without ranks.

Property tests (hypothesis) drive the allocator, then the real Scheduler with random
acceptance, tiny pools (so preemption and eviction happen), aborts and resets, and check
after every operation: free + cached free + in use = total in every pool, nothing in use is
evicted, tails are evicted before roots, and no page holding a draft slot (or a slot the
drafter has not written) is ever published. Hit lengths are checked as literals.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specray.config import SamplingParams
from specray.executor.scheduler import Scheduler, Sequence
from specray.kv.allocator import OutOfBlocks
from specray.kv.prefix_cache import CachedPool, PrefixCachingAllocator, extend_keys, page_key, shared_hit_length


def test_keys_chain_parent_tokens_salt_and_successor():
    tokens = list(range(40))
    keys = extend_keys([], tokens, 16, 40)
    assert len(keys) == 2 and keys[1] == page_key(keys[0], tokens[16:32], None)
    assert extend_keys([], tokens, 16, 40, salt="a")[0] != keys[0]
    assert extend_keys([], tokens, 16, 40, salt="a")[1] != keys[1]  # the salt reaches every page via the chain
    assert extend_keys([], tokens, 16, 31) == keys[:1]  # only whole pages below the limit
    shifted = extend_keys([], tokens, 16, 40, successor_tokens=1)
    assert shifted[0] == page_key(None, tokens[:17], None)  # keyed with the next token
    assert extend_keys([], tokens[:32], 16, 32, successor_tokens=1) == shifted[:1]  # page 2's successor is unknown
    assert extend_keys(keys[:1], tokens, 16, 40) == keys  # extending reuses the known prefix


def test_free_queues_published_pages_tail_first_and_evicts_the_oldest():
    a = PrefixCachingAllocator(6)
    seq1 = a.allocate(3)
    keys = extend_keys([], list(range(48)), 16, 48)
    for i, (b, k) in enumerate(zip(seq1, keys)):
        a.publish(b, k, keys[i - 1] if i else None)
    a.free(seq1)
    assert a.num_free == 6 and a.num_cached_free == 3
    assert a.lookup(keys) == seq1
    fresh = a.allocate(4)  # three never-published pages first, then one eviction: the chain's tail
    assert seq1[2] in fresh and a.lookup(keys) == seq1[:2]
    a.check_invariants()


def test_acquire_revives_a_cached_page_and_reset_forgets_every_key():
    a = PrefixCachingAllocator(4)
    b = a.allocate(1)
    key = page_key(None, [1] * 16, None)
    a.publish(b[0], key, None)
    a.free(b)
    assert a.num_to_revive(b) == 1
    a.acquire(b)
    a.acquire(b)
    assert a.refcount(b[0]) == 2 and a.num_cached_free == 0
    a.free(b)
    a.free(b)
    assert a.reset() == 1 and a.lookup([key]) == [] and a.num_free == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(b)
    with pytest.raises(OutOfBlocks):
        a.allocate(5)
    a.check_invariants()


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences over a 3-token alphabet (so prefixes collide) add, grow, publish what is
    verified, finish, abort or get preempted; allocation pressure evicts."""

    PAGE = 4

    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks):
        self.a = PrefixCachingAllocator(num_blocks)
        self.seqs: dict[int, dict] = {}
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=24), salt=st.sampled_from([None, "x"]))
    def add(self, tokens, salt):
        keys = extend_keys([], tokens, self.PAGE, len(tokens) - 1, salt=salt)
        hits = self.a.lookup(keys)
        need = -(-len(tokens) // self.PAGE) - len(hits)
        if need + self.a.num_to_revive(hits) > self.a.num_free:
            return
        self.a.acquire(hits)
        table = hits + self.a.allocate(need)
        self.seqs[self.next_id] = dict(tokens=list(tokens), salt=salt, table=table, keys=keys[:len(hits)],
                                       verified=len(hits) * self.PAGE)
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), grow=st.integers(1, 9), accept=st.integers(0, 9))
    def grow_and_verify(self, data, grow, accept):
        """Grow by ``grow`` slots (drafts); ``accept`` of them become verified tokens."""
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        s["verified"] = len(s["tokens"])
        need = -(-(len(s["tokens"]) + grow) // self.PAGE) - len(s["table"])
        if need > self.a.num_free:
            return
        s["table"] += self.a.allocate(need)
        s["tokens"] += [data.draw(st.integers(0, 2)) for _ in range(min(accept, grow))]
        keys = extend_keys(s["keys"], s["tokens"], self.PAGE, s["verified"], salt=s["salt"])
        for i in range(len(s["keys"]), len(keys)):
            assert (i + 1) * self.PAGE <= s["verified"]  # never a draft slot
            self.a.publish(s["table"][i], keys[i], keys[i - 1] if i else None)
        s["keys"] = keys
        keep = -(-len(s["tokens"]) // self.PAGE)  # roll back the pages of rejected drafts
        self.a.free(s["table"][keep:])
        del s["table"][keep:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_abort_or_preempt(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.a.free(self.seqs.pop(sid)["table"])

    @rule(n=st.integers(1, 6))
    def pressure(self, n):
        if n <= self.a.num_free:
            in_use = {b for s in self.seqs.values() for b in s["table"]}
            got = self.a.allocate(n)
            assert not in_use & set(got), "a page in use was handed out again"
            self.a.free(got)

    @rule()
    def reset(self):
        self.a.reset()
        for s in self.seqs.values():
            s["keys"] = []

    @invariant()
    def invariants(self):
        if hasattr(self, "a"):
            self.a.check_invariants()
            for s in self.seqs.values():
                for b in s["table"]:
                    assert self.a.refcount(b) >= 1


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- the scheduler ---------------------------------------------------------------------------

# method class -> (draft pool page size or None, where the drafter keeps KV, successor tokens)
KINDS = {"plain": (None, None, 0), "ngram": (None, None, 0), "draft_model": (32, "draft", 0),
         "dflash": (32, "draft", 0), "dspark": (64, "draft", 0), "eagle3": (None, "target", 1),
         "mtp": (None, "target", 1)}


def make_scheduler(kind: str, page: int, draft_page: int | None = None, num_blocks: int = 64, k: int = 3,
                   max_num_seqs: int = 8, budget: int = 1 << 20):
    default_draft, drafter_kv, shift = KINDS[kind]
    draft_page = draft_page or default_draft
    target = PrefixCachingAllocator(num_blocks)
    pools = [CachedPool("target", target, page, shift)]
    draft = None
    if draft_page is not None:
        draft = PrefixCachingAllocator(num_blocks * page // draft_page)
        pools.append(CachedPool("draft", draft, draft_page))
    k = 0 if kind == "plain" else k
    return Scheduler(target, page, max_num_seqs, budget, num_draft_tokens=k, draft_allocator=draft,
                     draft_tokens_per_block=draft_page or 0, prefix_pools=pools, drafter_kv=drafter_kv)


def step(sched: Scheduler, rng: random.Random, vocab: int = 50):
    """One step with made-up tokens: a drafting row accepts a random number of its k drafts."""
    plan = sched.schedule()
    tokens = []
    for sid, seq in zip(plan.seq_ids, [seq for seq in sched.running if seq.seq_id in plan.seq_ids]):
        assert seq.seq_id == sid
        if sid in plan.partial:
            tokens.append(None)
            continue
        n = rng.randint(0, seq.num_drafts_fed) if seq.num_drafts_fed else 0
        tokens.append([rng.randrange(vocab) for _ in range(n + 1)])
    sched.finish_step(tokens)
    check_budget(sched, plan)
    return plan


def check_budget(sched: Scheduler, plan) -> None:
    """Prefill chunks fit in what the decode and verify rows (1 + k each) leave of the budget."""
    k = sched.num_draft_tokens
    decode = sum(1 + (k if n else 0) for n, ids in zip(plan.num_drafts or [0] * len(plan.input_ids),
                                                         plan.input_ids) if len(ids) == 1 and n)
    prefill = sum(len(ids) for n, ids in zip(plan.num_drafts or [0] * len(plan.input_ids), plan.input_ids)
                  if not (len(ids) == 1 and n))
    assert prefill == 0 or decode + prefill <= sched.max_num_batched_tokens


def check_published(sched: Scheduler) -> None:
    """No running sequence has a published page past its verified (and drafter-written) KV."""
    for seq in sched.running:
        target_valid = seq.num_computed
        if sched.drafter_kv == "target":
            target_valid = min(target_valid, seq.num_draft_valid)
        tables = [(sched.allocator, seq.block_table, sched.tokens_per_block, target_valid)]
        if sched.draft_allocator is not None:
            tables.append((sched.draft_allocator, seq.draft_block_table, sched.draft_tokens_per_block,
                           seq.num_draft_valid))
        for allocator, table, page, valid in tables:
            for i, block in enumerate(table):
                if allocator.key_of(block) is not None:
                    assert (i + 1) * page <= valid, f"page {i} published past {valid} valid tokens"
    for pool in sched.prefix_pools:
        pool.allocator.check_invariants()


def sequence(sid: int, tokens: list[int], max_tokens: int, salt: str | None = None) -> Sequence:
    return Sequence(sid, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0,
                    cache_salt=salt)


def hit_after_cached(kind: str, page: int, draft_page: int | None, prompt_len: int) -> int:
    """The hit of a request of ``prompt_len`` tokens after one that had them all and more."""
    sched, rng = make_scheduler(kind, page, draft_page, num_blocks=4096 // page), random.Random(0)
    tokens = [rng.randrange(50) for _ in range(prompt_len + 300)]
    first = sequence(0, tokens, 3)
    sched.add(first)
    while sched.has_work:
        step(sched, rng)
    second = sequence(1, tokens[:prompt_len], 4)
    sched.add(second)
    plan = sched.schedule()
    assert plan.start_positions == [second.num_cached_tokens]
    if second.num_cached_tokens:
        assert plan.cached_prefix == {1: tokens[:second.num_cached_tokens]}
    return second.num_cached_tokens


# (kind, target page, draft page) -> hits for prompt lengths [3P - 1, 3P, 3P + 1, P - 1]: at most
# length - 1, rounded down to a multiple of both pages
HIT_LITERALS = {
    ("ngram", 16, None): [32, 32, 48, 0], ("ngram", 32, None): [64, 64, 96, 0],
    ("ngram", 64, None): [128, 128, 192, 0], ("ngram", 128, None): [256, 256, 384, 0],
    ("plain", 16, None): [32, 32, 48, 0], ("plain", 128, None): [256, 256, 384, 0],
    ("eagle3", 16, None): [32, 32, 48, 0], ("eagle3", 32, None): [64, 64, 96, 0],
    ("eagle3", 64, None): [128, 128, 192, 0], ("eagle3", 128, None): [256, 256, 384, 0],
    ("mtp", 16, None): [32, 32, 48, 0], ("mtp", 128, None): [256, 256, 384, 0],
    ("draft_model", 16, 32): [32, 32, 32, 0], ("draft_model", 16, 64): [0, 0, 0, 0],
    ("draft_model", 32, 32): [64, 64, 96, 0], ("draft_model", 32, 64): [64, 64, 64, 0],
    ("draft_model", 64, 32): [128, 128, 192, 0], ("draft_model", 64, 64): [128, 128, 192, 0],
    ("draft_model", 128, 32): [256, 256, 384, 0], ("draft_model", 128, 64): [256, 256, 384, 0],
    ("dflash", 16, 32): [32, 32, 32, 0], ("dflash", 32, 64): [64, 64, 64, 0],
    ("dflash", 128, 32): [256, 256, 384, 0], ("dspark", 16, 64): [0, 0, 0, 0],
    ("dspark", 64, 32): [128, 128, 192, 0], ("dspark", 128, 64): [256, 256, 384, 0],
}


@pytest.mark.parametrize("kind,page,draft_page", list(HIT_LITERALS))
def test_hit_lengths(kind, page, draft_page):
    lengths = [3 * page - 1, 3 * page, 3 * page + 1, page - 1]
    assert [hit_after_cached(kind, page, draft_page, n) for n in lengths] == HIT_LITERALS[kind, page, draft_page]


def test_shared_hit_length_rule():
    assert shared_hit_length(100, [(6, 16)]) == 96
    assert shared_hit_length(97, [(6, 16)]) == 96
    assert shared_hit_length(96, [(6, 16)]) == 80  # one token is always computed
    assert shared_hit_length(200, [(9, 16), (2, 64)]) == 128  # the shorter pool bounds it
    assert shared_hit_length(200, [(3, 16), (2, 64)]) == 0  # a multiple of every page size
    with pytest.raises(ValueError, match="num_tokens"):
        shared_hit_length(0, [(1, 16)])


@pytest.mark.parametrize("kind", ["draft_model", "dflash", "eagle3", "mtp"])
def test_a_prompt_only_request_is_hit_where_its_drafter_caught_up(kind):
    """A request that finished after its prefill never drafted; its prefill step names it in the
    plan's catch_up (every rank's drafter then writes every position but the last: 0..68), so
    the pages below are published and the next request hits 64 tokens. Rows that draft are never
    named: their draft writes the drafter's KV. Without prefix caching nothing is named."""
    sched, rng = make_scheduler(kind, 16), random.Random(1)
    tokens = list(range(70))
    sched.add(sequence(0, tokens, 1))
    plans = []
    while sched.has_work:
        plans.append(step(sched, rng))
    assert plans[0].catch_up == [0]
    again = sequence(1, tokens, 4)
    sched.add(again)
    step(sched, rng)  # admitted with its hit
    assert again.num_cached_tokens == 64
    while sched.has_work:
        plan = step(sched, rng)
        assert not set(plan.catch_up) & {sid for sid, n in zip(plan.seq_ids, plan.num_drafts) if n}
    uncached = make_scheduler(kind, 16)
    uncached.prefix_pools = []
    uncached.add(sequence(2, tokens, 1))
    assert uncached.schedule().catch_up == []


def test_plain_decoding_hits_after_a_one_token_request_and_salts_isolate():
    sched, rng = make_scheduler("plain", 16), random.Random(1)
    tokens = list(range(70))
    sched.add(sequence(0, tokens, 1, salt="a"))
    while sched.has_work:
        step(sched, rng)
    other, same = sequence(1, tokens, 2, salt="b"), sequence(2, tokens, 2, salt="a")
    sched.add(other)
    sched.add(same)
    sched.schedule()
    assert (other.num_cached_tokens, same.num_cached_tokens) == (0, 64)
    assert sched.prefix_pools[0].num_hit_tokens == 64 and sched.prefix_pools[0].num_query_tokens == 3 * 70  # every admission queries


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), page=st.sampled_from([16, 32]), num_blocks=st.integers(6, 14),
       budget=st.sampled_from([5, 16, 37, 1 << 20]), seed=st.integers(0, 10**6), ops=st.lists(st.sampled_from(["add", "step", "step", "step", "abort", "reset"]),
                                                 min_size=5, max_size=60))
def test_scheduler_pools_keep_their_invariants(kind, page, num_blocks, budget, seed, ops):
    """Random traffic on tiny pools: requests share prefixes (a small alphabet and a common
    stem), steps accept random draft counts, prompts are chunked by a token budget, requests
    are preempted, aborted and the cache reset; every pool's invariants hold after each
    operation, prefill chunks stay within the budget, and every page comes back."""
    rng = random.Random(seed)
    sched = make_scheduler(kind, page, num_blocks=num_blocks, max_num_seqs=3, budget=budget)
    capacity = num_blocks * page
    stem = [rng.randrange(3) for _ in range(2 * page)]
    seqs, sid = [], 0
    for op in ops:
        if op == "add":
            prompt = stem[:rng.randrange(1, 2 * page)] + [rng.randrange(3) for _ in range(rng.randrange(0, page))]
            max_tokens = rng.randint(1, max(1, min(3 * page, capacity // 2 - len(prompt) - 4)))
            if len(prompt) + max_tokens + 4 <= capacity // 2:
                seqs.append(sequence(sid, prompt, max_tokens, salt=rng.choice([None, "t"])))
                sched.add(seqs[-1])
                sid += 1
        elif op == "step" and sched.has_work:
            step(sched, rng, vocab=3)
        elif op == "abort" and seqs:
            victim = rng.choice(seqs)
            if not victim.is_finished:
                sched.abort(victim)
        elif op == "reset":
            sched.reset_prefix_cache()
        check_published(sched)
    for _ in range(5000):  # every request fits the pools alone: the work runs out
        if not sched.has_work:
            break
        step(sched, rng, vocab=3)
        check_published(sched)
    assert not sched.has_work
    sched.schedule()  # the last plan after the work ran out
    for pool in sched.prefix_pools:
        assert pool.allocator.num_free == pool.allocator.num_blocks
