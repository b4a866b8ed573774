"""Continuous-batching scheduler (plain Python, no torch).

Each step every scheduled sequence feeds tokens whose KV is not cached yet: one token when
it decodes, 1 + k tokens when it verifies drafts, and a chunk of its prompt (or, after a
preemption, of its prompt and output) while it prefills. Requests of any length share a step.

Chunked prefill: a step computes at most ``max_num_batched_tokens``. Decode and verify rows
come first (a verify row counts 1 + k), then prefill chunks fill what is left, in admission
order; a chunk ends anywhere (not at a page boundary). A chunk that does not reach the end
of the sequence's tokens samples nothing (``plan.partial``): its KV and, for drafters
conditioned on the target, its features are kept, and the drafter consumes them at the
sequence's first draft step with the true next tokens (so a shifted drafter never sees a
sampled token at a chunk's end). The row that computes the last chunk is a prefill row,
whatever its length: it samples the first token and does not draft, as an unchunked one.

Rules:
- admission is FIFO and by free pages: a waiting request joins when the pages for all of
  its current tokens are free, the batch has room (``max_num_seqs``) and the step's token
  budget has room for at least one token of it;
- when a running request needs a page and none is free, the most recently admitted
  running request is preempted: its pages are freed, and it waits at the front of the
  queue to be recomputed (prompt plus what it already generated), so no request fails;
- finishing frees every page of the request at once, and so does aborting it (``abort``),
  whether it runs or waits;
- a hybrid target's requests also need a free state slot to join, and give it back whenever
  they leave the running set (``executor/state_rows.py``).

Speculative decoding (``num_draft_tokens`` k > 0): a decoding sequence feeds its last token
and the ranks append k drafts, so its pages cover ``len(token_ids) + k`` slots; after the
step the drafts that were not accepted are rolled back: ``num_computed`` drops to the
verified tokens and every page past them goes back to the free list (target and draft
pool alike), and the next plan tells the ranks the new table lengths (``truncated``). The
drafter may propose fewer than k (ngram: none where nothing matches): the pages for k are
allocated all the same and the rollback frees what the shorter draft left empty; a step that
verified no draft is a plain decode step and is not counted as a verify step. A
standalone drafter's pool has its own allocator and page size; a sequence runs only when
both pools have its pages, and preemption and finishing release both.

Prefix caching (``prefix_pools`` given): ``executor/prefix_hits.py``.

Adaptive draft lengths (``choose_draft_lengths`` set, ``executor/adaptive.py``): before any
page is granted, the running sequences that decode this step (prefill rows excluded, so a
prefill arriving cannot change them) get a length each in [0, k]; a decoding sequence's
pages then cover ``len(token_ids) + its length`` and its row counts 1 + its length in the
budget. Without it every decoding sequence drafts k, as above.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specray.config import SamplingParams
from specray.executor.spec_metrics import SpecCounters
from specray.workers.plan import StepPlan
from specray.kv.allocator import BlockAllocator, blocks_needed
from specray.executor.prefix_hits import PrefixHits
from specray.executor.state_rows import StateRows
from specray.kv.state_slots import StateSlotAllocator
from specray.kv.prefix_cache import CachedPool


@dataclass(slots=True)
class Sequence:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    num_computed: int = 0  # tokens whose KV is in the pools
    block_table: list[int] = field(default_factory=list)
    num_blocks_sent: int = 0  # how much of block_table the ranks already know
    admitted_at: int = -1  # admission counter, for "most recently admitted"
    is_finished: bool = False
    num_preemptions: int = 0
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    text: object | None = None  # RequestText: the output text and its stop strings, when there is a tokenizer
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS and length
    draft_block_table: list[int] = field(default_factory=list)  # standalone drafter's pages
    num_draft_blocks_sent: int = 0
    num_drafts_fed: int = 0  # most drafts the step being run may verify (k when it decodes)
    accepted_counts: list[int] = field(default_factory=list)  # drafts accepted, per verify step
    draft_counts: list[int] = field(default_factory=list)  # drafts proposed, per verify step
    num_decode_steps: int = 0  # steps that decoded it, with drafts or without (not its prefills)
    cache_salt: str | None = None  # pages are shared only between requests of the same salt
    num_cached_tokens: int = 0  # prefix hit at its first admission
    num_draft_valid: int = 0  # positions whose drafter KV is surely written (a lower bound)
    page_keys: list[list] = field(default_factory=list)  # per prefix pool: keys of its published prefix
    is_sent: bool = False  # the ranks know its sampling params
    is_prefilling: bool = False  # admitted with a hit, or mid-prefill in chunks: a prefill row
    num_hit_unsent: int = 0  # a hit the ranks have not been told of yet

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        p = self.params
        is_stop_string = self.text is not None and self.text.add(token)
        if token in p.stop_token_ids:
            self._finish("stop", token)
        elif len(self.output_ids) >= p.max_tokens:
            self._finish("length", None)
        elif not p.ignore_eos and token in self.eos_token_ids:
            self._finish("stop", None)
        elif is_stop_string:
            self._finish("stop", self.text.stop_reason)

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.is_finished = True
        self.finish_s = time.perf_counter()
        self.finish_reason, self.stop_reason = reason, stop_reason


class Scheduler(PrefixHits, StateRows):
    def __init__(self, allocator: BlockAllocator, tokens_per_block: int, max_num_seqs: int,
                 max_num_batched_tokens: int, lookahead_tokens: int = 0, num_draft_tokens: int = 0,
                 draft_allocator: BlockAllocator | None = None, draft_tokens_per_block: int = 0,
                 prefix_pools: list[CachedPool] | None = None, drafter_kv: str | None = None,
                 state_allocator: StateSlotAllocator | None = None):
        self.allocator = allocator
        self._init_state_rows(state_allocator)  # hybrid targets: a state slot per running sequence
        # prefix caching: the target pool first, then a standalone drafter's; None: off
        self.prefix_pools = prefix_pools or []
        self.drafter_kv = drafter_kv  # where the drafter keeps KV: "target", "draft" or None
        self.draft_allocator = draft_allocator  # a standalone drafter's pool, else None
        self.draft_tokens_per_block = draft_tokens_per_block
        self.num_draft_tokens = num_draft_tokens
        self.tokens_per_block = tokens_per_block
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead_tokens = max(lookahead_tokens, num_draft_tokens)  # extra slots a step may write (drafts)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = itertools.count()
        self._preempted: list[int] = []  # since the last plan: ranks reset their block tables
        self._finished: list[int] = []  # since the last plan: ranks drop every trace of them
        self._truncated: dict[int, tuple[int, int]] = {}  # since the last plan: rolled-back table lengths
        self._scheduled: list[tuple[Sequence, int]] = []  # the last plan's rows: (sequence, tokens fed)
        self._catch_up: list[int] = []  # the last plan's rows whose drafter catches up (prefix_hits.py)
        self.spec_counters = SpecCounters(num_draft_tokens)  # cumulative over every request
        # adaptive speculation: decoding sequences -> their draft lengths this step; None: k each
        self.choose_draft_lengths: Callable[[list[Sequence]], list[int]] | None = None
        self.draft_lengths: dict[int, int] = {}  # this step's decoding sequences -> draft length

    def _decide_draft_lengths(self) -> None:
        decoding = [seq for seq in self.running if not self._is_prefill(seq)]
        if self.choose_draft_lengths is None or not self.num_draft_tokens:
            self.draft_lengths = {seq.seq_id: self.num_draft_tokens for seq in decoding}
            return
        lengths = self.choose_draft_lengths(decoding)
        if len(lengths) != len(decoding) or any(not 0 <= k <= self.num_draft_tokens for k in lengths):
            raise RuntimeError(f"draft lengths {lengths} for {len(decoding)} decoding sequences must each be in "
                               f"[0, num_draft_tokens = {self.num_draft_tokens}]")
        self.draft_lengths = {seq.seq_id: k for seq, k in zip(decoding, lengths)}

    def _lookahead(self, seq: Sequence) -> int:
        """Slots past its tokens a running sequence may write this step (its drafts)."""
        if self.choose_draft_lengths is None:
            return self.lookahead_tokens
        return self.draft_lengths.get(seq.seq_id, 0)  # a prefill row drafts nothing

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is: its pages (target and draft) go back at once, and the
        next plan tells the ranks to forget it if they ever saw it."""
        if seq in self.running:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self._preempted:
            self._preempted.remove(seq.seq_id)
        if seq.admitted_at >= 0:
            self._finished.append(seq.seq_id)
        seq.is_finished = True
        seq.finish_s = time.perf_counter()
        seq.finish_reason, seq.stop_reason = "abort", None

    def _pages_for(self, seq: Sequence, extra: int) -> tuple[int, int]:
        """Pages (target, draft) the sequence still needs to hold its tokens plus ``extra``."""
        tokens = len(seq.token_ids) + extra
        target = blocks_needed(tokens, self.tokens_per_block) - len(seq.block_table)
        if self.draft_allocator is None:
            return target, 0
        return target, blocks_needed(tokens, self.draft_tokens_per_block) - len(seq.draft_block_table)

    def _fits(self, need: tuple[int, int]) -> bool:
        draft_free = self.draft_allocator.num_free if self.draft_allocator is not None else 0
        return need[0] <= self.allocator.num_free and need[1] <= draft_free

    def _grant(self, seq: Sequence, need: tuple[int, int]) -> None:
        if need[0] > 0:
            seq.block_table += self.allocator.allocate(need[0])
        if need[1] > 0:
            seq.draft_block_table += self.draft_allocator.allocate(need[1])

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_state_slot(seq.seq_id)
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_blocks_sent = 0
        if self.draft_allocator is not None:
            self.draft_allocator.free(seq.draft_block_table)
        seq.draft_block_table = []
        seq.num_draft_blocks_sent = 0
        seq.num_draft_valid, seq.page_keys, seq.is_prefilling, seq.num_hit_unsent = 0, [], False, 0
        self._truncated.pop(seq.seq_id, None)

    def _preempt_latest(self) -> Sequence:
        victim = max(self.running, key=lambda s: s.admitted_at)
        self._release(victim)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self._preempted.append(victim.seq_id)
        self.waiting.appendleft(victim)
        return victim

    def schedule(self) -> StepPlan:
        # 0. The decoding sequences' draft lengths, before any page is granted.
        self._decide_draft_lengths()
        # 1. Running requests get the pages their next tokens need, preempting if short.
        for seq in sorted(self.running, key=lambda s: s.admitted_at):
            if seq not in self.running:
                continue  # preempted while serving an earlier one
            need = self._pages_for(seq, self._lookahead(seq))
            while not self._fits(need):
                if self._preempt_latest() is seq:
                    break
            if seq in self.running:
                self._grant(seq, need)
        # 2. Decode and verify rows first, then prefill chunks of running requests.
        budget, chunks = self.max_num_batched_tokens, {}
        for seq in self.running:
            if not self._is_prefill(seq):
                chunks[seq.seq_id] = 1
                budget -= 1 + self.draft_lengths.get(seq.seq_id, self.num_draft_tokens)
        for seq in self.running:
            if self._is_prefill(seq) and budget > 0:
                chunks[seq.seq_id] = min(seq.num_uncomputed, budget)
                budget -= chunks[seq.seq_id]
        # 3. Waiting requests join while pages, batch slots and the token budget allow.
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0 and self._has_free_state_slot():
            seq = self.waiting[0]
            hit, hit_pages, keys = self._find_hit(seq)
            need = self._pages_for(seq, self._lookahead(seq))  # adaptive: a prefill row drafts nothing
            need = (need[0] - len(hit_pages[0]), need[1] - (len(hit_pages[1]) if len(hit_pages) > 1 else 0))
            revive = [pool.allocator.num_to_revive(p) for pool, p in zip(self.prefix_pools, hit_pages)] + [0, 0]
            if not self._fits((need[0] + revive[0], need[1] + revive[1])):
                break
            self.waiting.popleft()
            self._take_hit(seq, hit, hit_pages, keys)
            self._grant(seq, need)
            self._take_state_slot(seq.seq_id)
            seq.admitted_at = next(self._admissions)
            self.running.append(seq)
            chunks[seq.seq_id] = min(seq.num_uncomputed, budget)
            budget -= chunks[seq.seq_id]
        return self._plan(chunks)

    @staticmethod
    def _is_prefill(seq: Sequence) -> bool:
        return seq.num_uncomputed > 1 or seq.is_prefilling

    def _plan(self, chunks: dict[int, int]) -> StepPlan:
        """The plan of the rows in ``chunks`` (sequence id -> tokens it computes), in running order."""
        plan = StepPlan(preempted=self._preempted, finished=self._finished, truncated=self._truncated,
                        state_rows=self._pop_state_rows())
        self._preempted, self._finished, self._truncated = [], [], {}
        self._scheduled = [(seq, chunks[seq.seq_id]) for seq in self.running if seq.seq_id in chunks]
        self._catch_up = plan.catch_up
        for seq, num_tokens in self._scheduled:
            plan.seq_ids.append(seq.seq_id)
            plan.input_ids.append(seq.token_ids[seq.num_computed:seq.num_computed + num_tokens])
            if seq.num_computed + num_tokens < len(seq.token_ids):  # a chunk short of the end: no sample
                plan.partial.append(seq.seq_id)
                seq.is_prefilling = True
            plan.start_positions.append(seq.num_computed)
            plan.new_blocks.append(seq.block_table[seq.num_blocks_sent:])
            seq.num_blocks_sent = len(seq.block_table)
            if not seq.is_sent:
                plan.new_seqs[seq.seq_id] = (seq.params, seq.seed)
                seq.is_sent = True
            if seq.num_hit_unsent:
                plan.cached_prefix[seq.seq_id] = seq.token_ids[:seq.num_hit_unsent]
                seq.num_hit_unsent = 0
            if self.num_draft_tokens:
                # only a decoding sequence drafts; a (re)computed prompt runs on the target alone
                is_decoding = not self._is_prefill(seq)
                seq.num_drafts_fed = self.draft_lengths.get(seq.seq_id, self.num_draft_tokens) if is_decoding else 0
                plan.num_drafts.append(seq.num_drafts_fed)
                if self._catches_up(seq, seq.seq_id in plan.partial):
                    plan.catch_up.append(seq.seq_id)
            if self.draft_allocator is not None:
                plan.new_draft_blocks.append(seq.draft_block_table[seq.num_draft_blocks_sent:])
                seq.num_draft_blocks_sent = len(seq.draft_block_table)
        return plan

    def finish_step(self, tokens: list[int] | list[list[int]], num_drafts: list[int] | None = None) -> list[Sequence]:
        """Record the new tokens of every scheduled sequence (one int each in plain decoding,
        a list of accepted drafts plus the bonus token when it verified drafts; None or [] for a
        partial chunk) and how many drafts each verified (None: as many as planned); returns
        the sequences that finished."""
        finished = []
        if num_drafts is None:
            num_drafts = [seq.num_drafts_fed for seq, _ in self._scheduled]
        caught_up = set(self._catch_up)
        for (seq, num_fed), new, proposed in zip(self._scheduled, tokens, num_drafts):
            if new is None or new == []:  # a partial chunk: its KV is in, nothing sampled
                seq.num_computed += num_fed
                self._publish(seq)
                continue
            new = new if isinstance(new, list) else [new]
            seq.num_decode_steps += 1 if seq.num_drafts_fed or seq.seq_id in self.draft_lengths else 0
            if (seq.num_drafts_fed or seq.seq_id in caught_up) and self.drafter_kv is not None:
                # the drafter consumed every position before the fed token (spec_step.py)
                seq.num_draft_valid = max(seq.num_draft_valid, len(seq.token_ids) - 1)
            seq.is_prefilling = False
            if proposed:  # a step that verified no draft was a plain decode step (as vLLM counts)
                seq.accepted_counts.append(len(new) - 1)
                seq.draft_counts.append(proposed)
                self.spec_counters.record(len(new) - 1, proposed)
            # every fed token is cached except the rejected drafts; the last new token is not fed yet
            seq.num_computed = len(seq.token_ids) + len(new) - 1
            if seq.params.max_tokens == 0:  # the prompt ran for its log-probabilities; nothing is generated
                seq._finish("length", None)
            for token in new if not seq.is_finished else ():
                seq.append(token)
                if seq.is_finished:
                    break
            self._publish(seq)
            if seq.is_finished:
                self._release(seq)
                self._finished.append(seq.seq_id)
                finished.append(seq)
            elif self.num_draft_tokens:
                self._roll_back(seq)
        return finished

    def _roll_back(self, seq: Sequence) -> None:
        """Free the pages that hold only rejected drafts (past the verified tokens)."""
        keep = blocks_needed(seq.num_computed, self.tokens_per_block)
        keep_draft = len(seq.draft_block_table)
        if self.draft_allocator is not None:
            keep_draft = blocks_needed(seq.num_computed, self.draft_tokens_per_block)
        if len(seq.block_table) <= keep and len(seq.draft_block_table) <= keep_draft:
            return
        self.allocator.free(seq.block_table[keep:])
        seq.block_table = seq.block_table[:keep]
        seq.num_blocks_sent = min(seq.num_blocks_sent, keep)
        if self.draft_allocator is not None:
            self.draft_allocator.free(seq.draft_block_table[keep_draft:])
            seq.draft_block_table = seq.draft_block_table[:keep_draft]
            seq.num_draft_blocks_sent = min(seq.num_draft_blocks_sent, keep_draft)
        self._truncated[seq.seq_id] = (keep, keep_draft)
