"""The start-up probe of adaptive speculation's step-cost model (issue 27, item 1).

Before the first request, rank 0 times a short fixed schedule of steps on dummy sequences and
fits ``StepCost`` to it: the prior of the online fit (``executor/adaptive.py``). The steps take
the ordinary step path: a throwaway ``Scheduler`` over the engine's own allocators (pages, draft
pages, state slots) builds the plans, and the engine's step function sends each plan to the
followers and runs rank 0's share, so every rank runs the same forwards with its own kernels and
collectives. Nothing here runs a model.

The schedule (``ProbeSize``: batch sizes S_1 < S_2, prompt P, R repetitions; k the ceiling),
each phase one warm-up step then R timed ones:
- prefill: a fresh sequence's prompt of P tokens alone (aborted after);
- plain 1, verify 1: one sequence at draft length 0, then at every length 1..k (a one-row
  step's verify is priced per length, ``executor/one_row.py``; the fit takes length k's);
- plain S, verify S, for S = S_1 then S_2: S sequences at draft length 0, then k.
S_1 is 4 and S_2 the largest batch up to 16 the engine allows (``MAX_PROBE_BATCH``; one batch
where that is 4 or less, halved until the pools and positions hold it): each batch
class's prior takes its plain line and its price of a verified draft from the batches around it
(``StepCostByBatch``), and a class whose steps all draft one length never corrects the split
between the two itself. Measured batches stop at 16 (the issue's largest concurrency); beyond,
the line through 4 and 16 extends.
A phase's time is the median of its R steps, not the minimum: a one-off stall (a page touched
first, a collective's first use, the garbage collector) moves a median less than a mean, and the
median is the typical step, which the online fit measures afterwards, where the minimum would be
the luckiest one. The warm-up step is dropped because it is not typical: a verify phase's first
step is where the drafter catches up on every prompt position (a draft model's KV).

No step drafts without verifying what it drafted, so the drafter's coefficients come from the
drafting part of the verify steps (``SpecRunner.draft_seconds``, rank 0's wall time of it): the
samples (``probe_fit.probe_samples``) are ``step_cost.probe_shapes``' six, "the drafter alone"
timed as the plain step of the same rows plus the verify's drafting time, and the verify of one
sequence.

Dummy tokens repeat a short pattern, and after each step the sampled token that ends a sequence
(never in the KV yet) is replaced by the pattern's next one, so prompt lookup (ngram) finds
drafts every step as on repetitive text; accepted drafts stay (their KV is written). Probe
sequences take negative ids, which no request has; the throwaway scheduler has no prefix pools,
so nothing is published to or looked up in the prefix cache; at the end every probe sequence is
aborted, the next plan tells every rank to forget it, and every page and state slot is free
again (checked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specray.config import EngineConfig, SamplingParams
from specray.errors import ConfigError
from specray.executor.adaptive import PRIOR_COST, AdaptiveDraftLengths, step_shape
from specray.executor.probe_fit import (PhaseTiming, fit_probe, one_row_seconds, phase_timing, plain_seconds,
                                       verify_slopes)
from specray.executor.scheduler import Scheduler, Sequence
from specray.executor.step_cost import StepCost, StepShape
from specray.kv.allocator import blocks_needed


MAX_PROBE_BATCH = 16  # the largest batch the probe times (the module docstring)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeSize:
    batch_sizes: tuple[int, ...]  # S_1 < S_2 ..., the batches of the "many" phases
    prompt_tokens: int  # P
    period: int  # of the dummy tokens' pattern (ids 1..period)
    repetitions: int = 3  # timed steps per phase

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or sizes[0] < 2 or list(sizes) != sorted(set(sizes)):
            raise ConfigError(f"ProbeSize.batch_sizes ({sizes!r}) must be one or more increasing batch sizes >= 2 "
                              f"(with batch 1, two sizes fix the per-row cost)")
        if self.prompt_tokens < 1 or self.period < 1 or self.repetitions < 1:
            raise ConfigError(f"ProbeSize needs prompt_tokens ({self.prompt_tokens}), period ({self.period}) and "
                              f"repetitions ({self.repetitions}) >= 1")

    @property
    def num_seqs(self) -> int:
        """The probe's largest batch: every sequence it holds at once."""
        return self.batch_sizes[-1]

    def longest(self, ceiling: int) -> int:
        """The most tokens a probe sequence reaches: its prompt, every decode step at 1 + k
        (k + 1 one-row phases and two per batch size, plus the steps that admit each batch: at
        most one per sequence added, the budget holding a prompt, and one more), and the lookahead."""
        num_phases = ceiling + 1 + 2 * len(self.batch_sizes)
        admitting = self.num_seqs + len(self.batch_sizes)
        return self.prompt_tokens + (num_phases * (self.repetitions + 1) + admitting) * (1 + ceiling) + ceiling


@dataclass(frozen=True, slots=True)
class ProbeResult:
    cost: StepCost
    seconds: float  # the probe's wall time, clean-up included
    num_steps: int
    size: ProbeSize
    verify_slopes: dict[int, float]  # seconds per verified draft by decode rows (StepCostByBatch's priors)
    plain_seconds: dict[int, float]  # a plain step's seconds by decode rows (the same)
    one_row_seconds: dict[int, float]  # a one-row step's seconds by verified drafts (OneRowVerify's seeds)

    def describe(self) -> str:
        batches = ", ".join(map(str, self.size.batch_sizes))
        return (f"probed in {self.seconds * 1e3:.0f} ms ({self.num_steps} steps, batches 1, {batches}, "
                f"prompt {self.size.prompt_tokens} tokens, median of {self.size.repetitions})")


def probe_size(scheduler: Scheduler, config: EngineConfig, vocab_size: int, max_len: int) -> ProbeSize | str:
    """The schedule's size on this engine, or why the probe cannot run on it: the largest batch
    up to ``MAX_PROBE_BATCH`` that the engine's limits, pools and positions allow, halved until
    one fits."""
    k, budget = scheduler.num_draft_tokens, scheduler.max_num_batched_tokens
    largest = min(MAX_PROBE_BATCH, scheduler.max_num_seqs, budget // (1 + k))
    if largest < 2:
        return (f"skipped: max_num_seqs ({scheduler.max_num_seqs}) and a step budget of {budget} tokens allow "
                f"{largest} sequence(s) of 1 + {k} rows, and the probe needs 2")
    period = min(8, vocab_size - 1)
    # ngram matches the latest n-gram earlier on: the prompt holds it and k tokens after it
    prompt = min(max(32, 2 * (period + k + (config.spec.prompt_lookup_max or 0))), budget)
    while True:
        size = ProbeSize(batch_sizes=tuple(sorted({min(4, largest), largest})), prompt_tokens=prompt, period=period)
        why = _does_not_fit(scheduler, size, max_len)
        if why is None:
            return size
        if largest // 2 < 2:
            return f"skipped: {why}"
        largest //= 2


def _does_not_fit(scheduler: Scheduler, size: ProbeSize, max_len: int) -> str | None:
    longest, draft = size.longest(scheduler.num_draft_tokens), scheduler.draft_allocator
    pages = (size.num_seqs * blocks_needed(longest, scheduler.tokens_per_block),
             size.num_seqs * blocks_needed(longest, scheduler.draft_tokens_per_block) if draft is not None else 0)
    is_short = pages[0] > scheduler.allocator.num_free or (draft is not None and pages[1] > draft.num_free)
    if longest > max_len or is_short:
        return (f"{size.num_seqs} sequences of up to {longest} tokens need {pages} (target, draft) pages and "
                f"max_position_embeddings >= {longest}; the pools or the model are smaller")
    return None


class ProbeRun:
    """The probe's schedule on one engine: its own scheduler and sequences, the engine's pools."""

    def __init__(self, main: Scheduler, step, worker, method: str, size: ProbeSize):
        self.scheduler = Scheduler(main.allocator, main.tokens_per_block, size.num_seqs, main.max_num_batched_tokens,
                                   num_draft_tokens=main.num_draft_tokens, draft_allocator=main.draft_allocator,
                                   draft_tokens_per_block=main.draft_tokens_per_block, drafter_kv=main.drafter_kv,
                                   state_allocator=main.state_allocator)  # no prefix pools: no hit, nothing published
        self.scheduler.choose_draft_lengths = lambda decoding: [self.length] * len(decoding)
        self.length = 0  # every decoding row's draft length in the phase being run
        self._step, self.worker, self.method, self.size = step, worker, method, size
        self.params = SamplingParams(max_tokens=size.longest(main.num_draft_tokens), ignore_eos=True)
        self.seqs: dict[int, Sequence] = {}
        self.num_steps = 0

    def token(self, position: int) -> int:
        return 1 + position % self.size.period

    def add(self) -> Sequence:
        sid = -1 - len(self.seqs)  # requests count up from 0
        prompt = [self.token(i) for i in range(self.size.prompt_tokens)]
        seq = self.seqs[sid] = Sequence(sid, prompt, len(prompt), self.params, seed=len(self.seqs))
        self.scheduler.add(seq)
        return seq

    def step(self) -> tuple[StepShape, float, float]:
        """One step of the probe's sequences: its shape, wall time and drafting time on rank 0."""
        plan = self.scheduler.schedule()
        planned = dict(self.scheduler.draft_lengths)  # the decoding rows; the others prefill
        started = time.perf_counter()
        tokens = self._step(plan)
        seconds = time.perf_counter() - started
        num_drafts = self.worker.num_drafts
        self.scheduler.finish_step(tokens, num_drafts)
        self.num_steps += 1
        for sid, new in zip(plan.seq_ids, tokens):
            seq = self.seqs[sid]
            if new is not None and new != [] and seq.num_uncomputed == 1:  # sampled, not in the KV yet
                seq.token_ids[-1] = self.token(len(seq.token_ids) - 1)
        spec = self.worker.spec
        return step_shape(self.method, plan, planned, num_drafts), seconds, spec.draft_seconds if spec else 0.0

    def phase(self, length: int) -> PhaseTiming:
        self.length = length
        steps = [self.step() for _ in range(self.size.repetitions + 1)]
        return phase_timing(steps[1:])  # the first is a warm-up (the module docstring)

    def run(self) -> dict[str, PhaseTiming]:
        k, timings, prefills = self.scheduler.num_draft_tokens, {}, []
        for _ in range(self.size.repetitions + 1):
            seq = self.add()
            prefills.append(self.step())
            self.scheduler.abort(seq)
        timings["prefill"] = phase_timing(prefills[1:])
        first = self.add()
        self._step_until_sampled([first], "the first sequence's prompt")
        timings["plain_one"] = self.phase(0)
        for length in range(1, k):  # OneRowVerify's seeds: a one-row step at every length
            timings[f"verify_one_{length}"] = self.phase(length)
        timings["verify_one"] = self.phase(k)
        for size in self.size.batch_sizes:
            running = sum(not seq.is_finished for seq in self.seqs.values())  # not the aborted prefill phase's
            others = [self.add() for _ in range(size - running)]
            self.length = 0
            self._step_until_sampled(others, f"admitting a batch of {size}")  # untimed
            timings[f"plain_{size}"], timings[f"verify_{size}"] = self.phase(0), self.phase(k)
        return timings

    def _step_until_sampled(self, seqs: list[Sequence], what: str) -> None:
        """Untimed steps until each of ``seqs`` has sampled a token: at most one step per prompt
        token (a step computes at least one), else an error rather than a loop without end."""
        for _ in range(self.size.prompt_tokens * len(seqs)):
            if all(seq.output_ids for seq in seqs):
                return
            self.step()
        if not all(seq.output_ids for seq in seqs):
            raise RuntimeError(f"the step-cost probe ({what}): {len(seqs)} sequence(s) of a {self.size.prompt_tokens}-"
                               f"token prompt sampled nothing in {self.size.prompt_tokens * len(seqs)} steps")

    def close(self) -> None:
        """Abort every probe sequence and tell the ranks to forget them (one plan of no rows)."""
        for seq in self.seqs.values():
            if not seq.is_finished:
                self.scheduler.abort(seq)
        self._step(self.scheduler.schedule())
        self.num_steps += 1


def _free_counts(scheduler: Scheduler) -> tuple[int, int, int]:
    draft, state = scheduler.draft_allocator, scheduler.state_allocator
    return (scheduler.allocator.num_free, draft.num_free if draft is not None else 0,
            state.num_free if state is not None else 0)


def probe_step_cost(scheduler: Scheduler, step, worker, config: EngineConfig) -> ProbeResult | str:
    """Run the probe (``step(plan)`` runs a plan on every rank); its fit, or why it did not run."""
    arch = worker.arch
    size = probe_size(scheduler, config, arch.vocab_size, arch.max_position_embeddings)
    if isinstance(size, str):
        return size
    free = _free_counts(scheduler)
    started = time.perf_counter()
    run = ProbeRun(scheduler, step, worker, config.spec.method, size)
    timings = run.run()
    run.close()
    seconds = time.perf_counter() - started
    if _free_counts(scheduler) != free:
        raise RuntimeError(f"the step-cost probe left (target pages, draft pages, state slots) free at "
                           f"{_free_counts(scheduler)}, not {free} as before it: it must give back all it took")
    return ProbeResult(fit_probe(timings), seconds, run.num_steps, size, verify_slopes(timings),
                       plain_seconds(timings), one_row_seconds(timings))


def adaptive_draft_lengths(scheduler: Scheduler, step, worker, config: EngineConfig) -> AdaptiveDraftLengths:
    """Adaptive speculation's controller, its cost model starting from the probe's fit (or, with
    ``SpecConfig.adaptive_probe=False`` or where the probe cannot run, from ``PRIOR_COST``)."""
    spec = config.spec
    # dspark's confidence head decides what is verified, unless the user fixed its threshold
    gated = spec.dspark_confidence_threshold is None and getattr(worker.drafter, "has_confidence_head", False)
    probe = probe_step_cost(scheduler, step, worker, config) if spec.adaptive_probe else "off (adaptive_probe=False)"
    if isinstance(probe, str):
        return AdaptiveDraftLengths(spec.method, scheduler.num_draft_tokens, prior=PRIOR_COST, prior_source="fixed",
                                    probe_note=f"fixed (the probe {probe})", confidence_gated=gated)
    return AdaptiveDraftLengths(spec.method, scheduler.num_draft_tokens, prior=probe.cost, prior_source="probed",
                                probe_note=probe.describe(), confidence_gated=gated, verify_slopes=probe.verify_slopes,
                                plain_seconds=probe.plain_seconds, one_row_seconds=probe.one_row_seconds)
