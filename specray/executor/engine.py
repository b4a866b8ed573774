"""EngineCore: the coordinator that runs in rank 0's process.

It owns one persistent scheduler and rank 0's worker, and drives every step: plan, send the
plan to the followers, execute, record the tokens, and turn them into per-request deltas.
Requests join (``add``) and leave (``abort``) between any two steps; ``executor/loop.py``
runs the loop around it, and the driver only writes its inbox and reads its outbox.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from specray.config import EngineConfig, SamplingParams
from specray.errors import GrammarError
from specray.executor import spec_metrics
from specray.executor.outputs import AddRequests, EngineStats, RequestDelta, RequestOutput  # noqa: F401 (re-export)
from specray.executor.probe import adaptive_draft_lengths
from specray.executor.scheduler import Scheduler, Sequence
from specray.executor.state_rows import state_slot_allocator
from specray.executor.text import ChatPrompt, RequestText, encode_prompt, engine_tokenizer
from specray.workers.logprobs import TokenLogprob
from specray.workers.plan import StepPlan
from specray.kv.allocator import BlockAllocator
from specray.kv.prefix_cache import CachedPool, PrefixCachingAllocator
from specray.workers.worker import RankWorker

log = logging.getLogger(__name__)


def validate_requests(prompts: list[list[int]], params: list[SamplingParams], vocab_size: int,
                      capacity_tokens: int, lookahead_tokens: int, max_model_len: int,
                      labels: list | None = None) -> None:
    """Reject the whole call before anything runs, so no request is half served.

    The error names the request (``labels[i]``, its index by default), the value and the rule."""
    if len(prompts) != len(params):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one or one per prompt")
    labels = list(range(len(prompts))) if labels is None else labels
    for i, prompt, p in zip(labels, prompts, params):
        if len(prompt) == 0:
            raise ValueError(f"request {i}: the prompt is empty; a prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        need = len(prompt) + p.max_tokens + lookahead_tokens
        if need > capacity_tokens:
            raise ValueError(
                f"request {i}: prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens})"
                + (f" + draft lookahead ({lookahead_tokens})" if lookahead_tokens else "")
                + f" = {need} exceeds the KV pool capacity ({capacity_tokens} tokens); "
                f"shorten the request or give the pool more memory"
            )
        if len(prompt) + p.max_tokens > max_model_len:
            raise ValueError(
                f"request {i}: prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) = "
                f"{len(prompt) + p.max_tokens} exceeds the model's max_position_embeddings ({max_model_len}); "
                f"shorten the request"
            )



@dataclass(slots=True)
class LiveRequest:
    """A request between its ``add`` and its last delta."""

    request_id: str
    seq: Sequence
    num_sent: int = 0  # output tokens already sent in deltas
    has_sent: bool = False  # a delta went out (the first carries the prompt's token ids)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when asked
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # per prompt token, when asked
    has_sent_prompt_logprobs: bool = False


class EngineCore:
    def __init__(self, config: EngineConfig, worker: RankWorker, channel=None):
        self.config = config
        self.worker = worker
        self.channel = channel  # sends plans to the followers; None on a single rank
        self.is_broken = False  # a step failed midway: the ranks may disagree, serve no more
        self.geometry = worker.geometry  # agreed by every rank before the engine starts
        target, draft = self.geometry["target"], self.geometry.get("draft")
        allocator = PrefixCachingAllocator if config.kv.enable_prefix_caching else BlockAllocator
        self.allocator = allocator(target.num_blocks)
        # a standalone drafter's pool: its own pages (its page size may differ), same token capacity
        self.draft_allocator = allocator(draft.num_blocks) if draft is not None else None
        self.num_draft_tokens = config.spec.num_draft_tokens if config.spec.is_enabled else 0
        self.prefix_pools, drafter_kv = self._prefix_pools(worker.drafter)
        self.state_allocator = state_slot_allocator(self.geometry.get("state"), config.max_num_seqs,
                                                    self.num_draft_tokens)
        self.scheduler = Scheduler(self.allocator, target.tokens_per_block, config.max_num_seqs,
                                   config.step_token_budget, num_draft_tokens=self.num_draft_tokens,
                                   draft_allocator=self.draft_allocator,
                                   draft_tokens_per_block=draft.tokens_per_block if draft is not None else 0,
                                   prefix_pools=self.prefix_pools, drafter_kv=drafter_kv,
                                   state_allocator=self.state_allocator)
        self.adaptive = None  # adaptive speculation: the draft lengths of each step (executor/adaptive.py)
        if config.spec.is_enabled and config.spec.adaptive:
            # its cost model starts from steps timed on every rank now, before any request (probe.py)
            self.adaptive = adaptive_draft_lengths(self.scheduler, self._step, worker, config)
            self.scheduler.choose_draft_lengths = self.adaptive.choose
        self.live: dict[str, LiveRequest] = {}
        self._by_seq: dict[int, LiveRequest] = {}
        self._needs_settle = False  # steps ran since the ranks last compared their tokens
        self._seq_ids = 0
        self._rng = random.Random(config.seed)
        self.tokenizer = engine_tokenizer(config)  # None: the model speaks token ids only

    def _prefix_pools(self, drafter) -> tuple[list[CachedPool], str | None]:
        """The pools the prefix cache covers (none when it is off) and where the drafter keeps KV."""
        drafter_kv = None
        if drafter is not None and drafter.kv_layout is not None:
            drafter_kv = "draft" if drafter.is_standalone else "target"
        # hybrid targets: a hit would need the linear layers' state at the hit's end, which no page
        # holds (docs/models.md), so their prefix cache stays off
        if not self.config.kv.enable_prefix_caching or "state" in self.geometry:
            return [], drafter_kv
        # one-model drafters whose KV at p depends on token p + 1 key the target's pages with it
        shift = getattr(drafter, "kv_successor_tokens", 0) if drafter_kv == "target" else 0
        pools = [CachedPool("target", self.allocator, self.geometry["target"].tokens_per_block, shift)]
        if self.draft_allocator is not None:
            pools.append(CachedPool("draft", self.draft_allocator, self.geometry["draft"].tokens_per_block))
        return pools, drafter_kv

    @property
    def capacity_tokens(self) -> int:
        return self.geometry["target"].capacity_tokens

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def _step(self, plan: StepPlan) -> list[int]:
        if self.channel is not None:
            self.channel.send(plan)
        return self.worker.execute(plan)

    def add(self, message: AddRequests) -> None:
        """Encode and validate every request of ``message``, then add them all: a ValueError
        naming the request (its label) adds none, so no request of a call is half served."""
        if self.is_broken:
            raise RuntimeError("the engine stopped after a failed step; close it and start a new one")
        ids, prompts, params = (list(column) for column in zip(*message.requests)) if message.requests else ([],) * 3
        labels = message.labels
        seen = set(self.live)
        for label, rid in zip(labels, ids):
            if rid in seen:
                raise ValueError(f"request {label}: request id {rid!r} is already running; request ids must be unique")
            seen.add(rid)
        arch = self.worker.arch
        encoded = [encode_prompt(self.tokenizer, p, label, self.config.model) for label, p in zip(labels, prompts)]
        for label, p in zip(labels, params):
            if p.stop and self.tokenizer is None:
                raise ValueError(f"request {label}: stop strings {list(p.stop)} need a tokenizer, and model "
                                 f"{self.config.model!r} has none; use stop_token_ids")
        validate_requests(encoded, params, arch.vocab_size, self.capacity_tokens, self.num_draft_tokens,
                          arch.max_position_embeddings, labels)
        for label, p in zip(labels, params):  # compiled here, once per distinct spec; the ranks reuse it
            if p.structured is not None:
                try:
                    self.worker.grammars.compile(p.structured)
                except GrammarError as err:
                    raise GrammarError(f"request {label}: {err}") from None
        for rid, ids_, p, prompt in zip(ids, encoded, params, prompts):
            request = LiveRequest(rid, self._sequence(ids_, p, isinstance(prompt, ChatPrompt)))
            self.live[rid] = self._by_seq[request.seq.seq_id] = request
            self.scheduler.add(request.seq)

    def abort(self, request_ids: list[str]) -> list[RequestDelta]:
        """Stop these requests now: their pages go back to every pool's free list and the next
        plan tells the followers to forget them. Ids not running (finished, unknown) are skipped."""
        deltas = []
        for rid in request_ids:
            request = self.live.get(rid)
            if request is None:
                continue
            self.scheduler.abort(request.seq)
            self._needs_settle = True
            deltas.append(self._delta(request))
        return deltas

    def step(self) -> list[RequestDelta]:
        """One step of every scheduled request; a delta for each that got a token (a partial
        prefill chunk gets none)."""
        if self.is_broken:
            raise RuntimeError("the engine stopped after a failed step; close it and start a new one")
        try:
            plan = self.scheduler.schedule()
            if self.adaptive is not None:
                plan.verify_threshold = self.adaptive.verify_threshold  # None unless confidence-gated
            self._ask_prompt_logprobs(plan)
            started = time.perf_counter()
            tokens = self._step(plan)
            seconds = time.perf_counter() - started
            num_before = [len(self._by_seq[sid].seq.output_ids) for sid in plan.seq_ids]
            self.scheduler.finish_step(tokens, self.worker.num_drafts)
            if self.adaptive is not None:
                self.adaptive.observe(plan, self.worker.num_drafts, tokens, seconds)
            self._keep_logprobs(plan, num_before)
        except BaseException:
            self.is_broken = True
            raise
        self._needs_settle = True
        return [self._delta(self._by_seq[sid]) for sid in plan.seq_ids if sid not in plan.partial]

    def _ask_prompt_logprobs(self, plan: StepPlan) -> None:
        """Name in the plan the sequences whose prompt runs now and that want its log-probabilities,
        with the prompt token after the fed ones (None when they end the prompt)."""
        for sid, start, ids in zip(plan.seq_ids, plan.start_positions, plan.input_ids):
            request = self._by_seq[sid]
            seq, recorded = request.seq, request.prompt_logprobs
            if seq.params.prompt_logprobs is None or start >= seq.prompt_len or len(recorded) == seq.prompt_len:
                continue  # not asked, a decode, or a recomputation after preemption (already known)
            if not recorded:
                recorded.append(None)  # the first prompt token has nothing before it
            del recorded[start + 1:]  # a prompt preempted between its chunks runs again from its start
            if len(recorded) != start + 1:
                raise RuntimeError(f"request {request.request_id!r}: the prompt runs from position {start} but its "
                                   f"log-probabilities are known up to {len(recorded) - 1}; a request that asks for "
                                   f"prompt log-probabilities must compute its whole prompt (no prefix-cache hit)")
            end = start + len(ids)
            plan.prompt_logprobs[sid] = seq.token_ids[end] if end < seq.prompt_len else None

    def _keep_logprobs(self, plan: StepPlan, num_before: list[int]) -> None:
        """Rank 0's worker computed the step's log-probabilities; keep those of the tokens the
        sequences really took (a stop in the middle of the accepted drafts drops the rest)."""
        rows = self.worker.step_logprobs
        for i, sid in enumerate(plan.seq_ids):
            request = self._by_seq[sid]
            request.prompt_logprobs += self.worker.step_prompt_logprobs.get(sid, [])
            if rows is not None and rows[i] is not None:
                request.logprobs += rows[i][:len(request.seq.output_ids) - num_before[i]]

    def settle(self) -> None:
        """When the work runs out: the call-end plan lets the ranks forget the last finished
        sequences now and compare their token digests (workers/token_check.py)."""
        end = self.scheduler.schedule()
        end.is_call_end = True
        try:
            self._step(end)
        except BaseException:
            self.is_broken = True
            raise
        self._needs_settle = False

    @property
    def needs_settle(self) -> bool:
        return self._needs_settle and not self.scheduler.has_work

    def _sequence(self, prompt: list[int], params: SamplingParams, is_chat: bool) -> Sequence:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = self.worker.arch.eos_token_ids
        if is_chat or params.structured is not None:  # a chat answer (or a grammar's text) also ends at end of turn
            eos = tuple(dict.fromkeys(eos + tuple(self.tokenizer.end_of_turn_ids)))
        text = RequestText(self.tokenizer, prompt, params) if self.tokenizer is not None else None
        seq = Sequence(self._seq_ids, list(prompt), len(prompt), params, seed, eos, text=text,
                       cache_salt=params.cache_salt)
        self._seq_ids += 1
        return seq

    def _delta(self, request: LiveRequest) -> RequestDelta:
        """What the request gained since its last delta; the last one carries its metrics."""
        seq = request.seq
        new = seq.output_ids[request.num_sent:]
        is_first, request.has_sent, request.num_sent = not request.has_sent, True, len(seq.output_ids)
        text = ""
        if seq.text is not None:
            if seq.is_finished and seq.finish_reason != "abort":
                seq.text.finish()
            text = seq.text.take_new(seq.is_finished)
        delta = RequestDelta(request.request_id, new, text, seq.prompt_len, len(seq.output_ids),
                             seq.finish_reason, seq.stop_reason,
                             prompt_token_ids=seq.token_ids[:seq.prompt_len] if is_first else None)
        if seq.params.logprobs is not None:
            delta.new_logprobs = request.logprobs[len(seq.output_ids) - len(new):len(seq.output_ids)]
        if len(request.prompt_logprobs) == seq.prompt_len and not request.has_sent_prompt_logprobs:
            delta.prompt_logprobs, request.has_sent_prompt_logprobs = request.prompt_logprobs, True
        if seq.is_finished:
            delta.metrics = self._metrics(seq)
            del self.live[request.request_id], self._by_seq[seq.seq_id]
        return delta

    def _metrics(self, seq: Sequence) -> dict:
        out, k = seq.output_ids, self.num_draft_tokens
        first = seq.first_token_s
        ttft = first - seq.arrival_s if first is not None else None
        tpot = (seq.finish_s - first) / (len(out) - 1) if len(out) > 1 else 0.0
        metrics = dict(ttft_s=ttft, tpot_s=tpot, num_output_tokens=len(out), num_preemptions=seq.num_preemptions,
                       num_cached_tokens=seq.num_cached_tokens)
        if k:
            metrics.update(spec_metrics.request_metrics(seq.accepted_counts, k, seq.draft_counts,
                                                        seq.num_decode_steps))
        return metrics

    def stats(self) -> EngineStats:
        """A snapshot: requests running and waiting, pages in use per pool (cached free pages count
        as free), the spec counters, the prefix cache's counters per pool."""
        s = self.scheduler
        usage = {"target": 1 - self.allocator.num_free / self.allocator.num_blocks}
        if self.draft_allocator is not None:
            usage["draft"] = 1 - self.draft_allocator.num_free / self.draft_allocator.num_blocks
        if self.state_allocator is not None:
            usage["state"] = 1 - self.state_allocator.num_free / self.state_allocator.num_slots
        c = s.spec_counters
        return EngineStats(len(s.running), len(s.waiting), usage, c.num_drafts, c.num_draft_tokens,
                           c.num_accepted_tokens, list(c.accepted_per_position),
                           {p.name: p.num_query_tokens for p in self.prefix_pools},
                           {p.name: p.num_hit_tokens for p in self.prefix_pools},
                           self.adaptive.stats() if self.adaptive is not None else {})

    def close(self) -> None:
        if self.channel is not None and not self.is_broken:
            self.channel.send(StepPlan(is_shutdown=True))
