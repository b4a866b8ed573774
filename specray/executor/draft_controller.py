"""The adaptive controller: each request's acceptance evidence, and each step's draft lengths
from it through ``draft_length.best_lengths``, with hysteresis and probes (plain Python, no
torch). executor/adaptive.py wires it into the step loop.

Each request has a per-position acceptance estimate p_i: the probability that draft i is
accepted given that drafts before it were. What a verify step shows (drafts 0..n-1 accepted,
draft n rejected when n < proposed, later ones unseen) is counted per position, twice:

- in the request's own evidence (hits and trials, every count decayed by ``ema_weight`` when its
  position is seen again, so the newest verify weighs that much);
- in the engine-wide population (the same counts over every request, decayed by
  1 / ``population_memory``): what a request should expect before it has shown anything.

The population's estimate of position 0 is its hits over its trials with ``prior_acceptance``
counted as one trial; a deeper position i counts position i-1's estimate as its one prior trial
(a position no request reached yet is expected to do as the one before it, so a drafter that
is always right is tried at the ceiling after its first verified draft, not one position per
probe). A request's p_i is its own hits over trials with the population's p_i counted as
``population_weight`` trials, so a new request starts where the engine's requests left off,
and a request unlike them moves away within a few verifies.

Hysteresis: the previous step's lengths are kept (a new request starts at the best) unless
the best choice's modelled goodput beats theirs by more than ``switch_margin`` (5%): timing
noise moves the fit a little every step, and a near-tie would otherwise flap.

Staleness of the estimate: a request at length 0 shows nothing, so after ``probe_interval``
steps without a verify it drafts one token (a probe) to refresh p_0. A fresh engine first warms
the population up: until ``warmup_verifies`` verifies engine-wide have shown a draft, every row at
length 0 probes at every step, whatever it has left. One rejected probe otherwise set the
population's p_0 from the prior's 0.5 to 0.25, every request after it started at 0, and none had
the steps left to probe: measured 12-07 (prompt lookup, concurrency 1, 48-token requests), a
fresh engine's first request probed once, was rejected, and the engine ran plain through 250
steps (5 requests) until a population probe fell due, where the same chats drafted 1 and 3 on a
warmed engine (its first pass of the 17:05 grid ran at 0.91 of the best static k, the next 1.03). A step that
probes takes along every row at 0 past half its interval, so that probes fall on few steps.
A probe pays only through the steps that use what it shows: a request with ``probe_interval``
steps or fewer left (its ``max_tokens``) does not probe, unless no draft has been verified
engine-wide for ``population_probe_interval`` steps (the population, which every new request
starts from, must not freeze either). Measured on the trained EAGLE-3 at concurrency 1 (48-token
requests): a probe step took 27.5 ms against a 6 ms plain step (the drafter catches up on the
prompt and the paused steps), and each request's probe at its step 32 cost ~4% of the run.
That interval stretches by what a probe's catch-up costs over a plain step (``resume_seconds``
over the modelled plain step, where more than 1), so such probes take about the share of the
engine's time that one plain step in ``population_probe_interval`` does: measured 12-07 at
concurrency 1 with the same drafter, where drafting never paid, every pass of 768 steps drafted
only its 3-4 population probes, each ~24 ms (a catch-up of 14 ms), about 1% of the run.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from specray.errors import ConfigError
from specray.executor.draft_length import best_lengths, check_ceiling, draft_forwards, goodput
from specray.executor.step_cost import StepCost


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftLengthPolicy:
    ceiling: int
    """The longest draft (SpecConfig.num_draft_tokens)."""
    ema_weight: float = 0.25
    """The weight of the newest verify step in a request's own evidence at each position."""
    prior_acceptance: float = 0.5
    """Position 0's estimate before any request has shown anything (one trial's weight)."""
    population_weight: float = 2.0
    """Trials the engine-wide estimate counts as in each request's estimate."""
    population_memory: int = 64
    """Verifies of a position the engine-wide estimate remembers (its counts decay by 1 / this)."""
    switch_margin: float = 0.05
    """Keep the previous lengths unless the best beats their modelled goodput by this fraction."""
    probe_interval: int = 32
    """Steps without a verify after which a request at length 0 drafts one token (a probe), where
    it has more steps left than this to use what the probe shows."""
    population_probe_interval: int = 256
    """Steps without any verified draft engine-wide after which a due request probes whatever it
    has left; where a probe's catch-up costs more than a plain step, that many times longer (the
    module docstring)."""
    warmup_verifies: int = 8
    """Verifies that showed a draft engine-wide before the population's estimate is used alone:
    until then every row at length 0 probes (the module docstring). 0: no warm-up."""

    def __post_init__(self) -> None:
        check_ceiling(self.ceiling)
        _require_in(self.ema_weight, "ema_weight", 0.0, 1.0, low_open=True)
        _require_in(self.prior_acceptance, "prior_acceptance", 0.0, 1.0)
        if not (isinstance(self.population_weight, (int, float)) and self.population_weight >= 0):
            raise ConfigError(f"population_weight ({self.population_weight!r}) must be >= 0 (trials)")
        if not isinstance(self.population_memory, int) or self.population_memory < 1:
            raise ConfigError(f"population_memory ({self.population_memory!r}) must be an integer >= 1 (verifies)")
        if not (isinstance(self.switch_margin, (int, float)) and self.switch_margin >= 0):
            raise ConfigError(f"switch_margin ({self.switch_margin!r}) must be >= 0 (a fraction of goodput)")
        if not isinstance(self.probe_interval, int) or self.probe_interval < 1:
            raise ConfigError(f"probe_interval ({self.probe_interval!r}) must be an integer >= 1 (steps)")
        if not isinstance(self.population_probe_interval, int) or self.population_probe_interval < 1:
            raise ConfigError(f"population_probe_interval ({self.population_probe_interval!r}) must be an "
                              f"integer >= 1 (steps)")
        if not isinstance(self.warmup_verifies, int) or self.warmup_verifies < 0:
            raise ConfigError(f"warmup_verifies ({self.warmup_verifies!r}) must be an integer >= 0 (verifies)")


def _require_in(value, name: str, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        raise ConfigError(f"{name} ({value!r}) must be in {'(' if low_open else '['}{low}, {high}]")


@dataclass(slots=True)
class Evidence:
    """Per-position acceptance counts (hits, trials), each position's decayed by ``decay`` when
    it is seen again (see the module docstring)."""

    hits: list[float]
    trials: list[float]
    decay: float

    @classmethod
    def empty(cls, ceiling: int, decay: float) -> Evidence:
        return cls([0.0] * ceiling, [0.0] * ceiling, decay)

    def record(self, proposed: int, accepted: int) -> None:
        if not 0 <= accepted <= proposed <= len(self.trials):
            raise ConfigError(f"accepted ({accepted}) <= proposed ({proposed}) <= ceiling ({len(self.trials)}) "
                              f"must hold, each >= 0")
        # drafts 0..accepted-1 held; draft `accepted` was rejected if it was proposed; later ones unseen
        keep = 1.0 - self.decay
        for i in range(min(accepted + 1, proposed)):
            self.hits[i] = keep * self.hits[i] + (i < accepted)
            self.trials[i] = keep * self.trials[i] + 1.0

    def estimate(self, prior: list[float], weight: float) -> list[float]:
        """Hits over trials per position, ``prior[i]`` counted as ``weight`` trials."""
        return [(weight * q + h) / (weight + n) if weight + n > 0 else q
                for q, h, n in zip(prior, self.hits, self.trials)]

    def population_estimate(self, prior_acceptance: float) -> list[float]:
        """Position 0 shrunk to ``prior_acceptance``, each deeper one to the estimate before it
        (one trial each): the population's expectation of every position."""
        out, prior = [], prior_acceptance
        for h, n in zip(self.hits, self.trials):
            prior = (prior + h) / (1.0 + n)
            out.append(prior)
        return out


@dataclass(slots=True)
class RequestAcceptance:
    evidence: Evidence
    steps_unverified: int = 0  # steps since it last verified a draft


@dataclass(slots=True)
class DraftLengthController:
    """The lengths of each step's decode rows, with hysteresis and probes; counts the choices."""

    policy: DraftLengthPolicy
    method: str
    requests: dict[int, RequestAcceptance] = field(default_factory=dict)
    chosen: dict[int, int] = field(default_factory=dict)  # each request's held length (before probes)
    last_run: dict[int, int] = field(default_factory=dict)  # each request's length at its last step (probes in)
    length_histogram: Counter = field(default_factory=Counter)  # decode rows per length run
    num_steps_without_drafting: int = 0
    num_switches: int = 0  # steps whose held lengths changed for a request that already had one
    steps_since_verify: int = 0  # steps since any request verified a draft (engine-wide)
    num_verifies: int = 0  # verifies that showed a draft, engine-wide (the warm-up counts them)
    population: Evidence = field(init=False)  # every request's verifies, engine-wide

    def __post_init__(self) -> None:
        self.population = Evidence.empty(self.policy.ceiling, 1.0 / self.policy.population_memory)

    def _state(self, seq_id: int) -> RequestAcceptance:
        if seq_id not in self.requests:
            self.requests[seq_id] = RequestAcceptance(Evidence.empty(self.policy.ceiling, self.policy.ema_weight))
        return self.requests[seq_id]

    @property
    def is_warming_up(self) -> bool:
        """Fewer than ``warmup_verifies`` verifies engine-wide have shown a draft."""
        return self.num_verifies < self.policy.warmup_verifies

    def population_estimate(self) -> list[float]:
        return self.population.population_estimate(self.policy.prior_acceptance)

    def estimates(self, seq_id: int) -> list[float]:
        """The acceptance estimate per position of a request (the population's for a new one)."""
        state = self.requests.get(seq_id)
        population = self.population_estimate()
        return population if state is None else state.evidence.estimate(population, self.policy.population_weight)

    def decide(self, decode_ids: list[int], cost: StepCost, steps_left: list[int | None] | None = None,
               resume_seconds: float = 0.0) -> list[int]:
        """Lengths for this step's decode rows (prefill rows are not passed: they never draft);
        ``steps_left``: the most steps each may still decode, this one included (None: unbounded);
        ``resume_seconds``: what a drafter's catch-up costs a row that did not draft at its last
        step (``resume_charges``)."""
        draft_forwards(self.method, 0)  # an unknown method fails here, before any state changes
        steps_left = steps_left or [None] * len(decode_ids)
        states = [self._state(s) for s in decode_ids]
        population = self.population_estimate()
        probs = [st.evidence.estimate(population, self.policy.population_weight) for st in states]
        charges = self.resume_charges(decode_ids, steps_left, resume_seconds)
        best = best_lengths(probs, cost, self.method, self.policy.ceiling, charges)
        held = [self.chosen.get(s, b) for s, b in zip(decode_ids, best)]
        lengths = held
        if best != held and goodput(probs, best, cost, self.method, charges) > \
                (1 + self.policy.switch_margin) * goodput(probs, held, cost, self.method, charges):
            lengths = best
            self.num_switches += 1  # a row that differs already had a length (a new one holds the best)
        self.chosen.update(zip(decode_ids, lengths))
        plain = cost.seconds(len(decode_ids), 0, 0, 0, 0)
        catch_up = resume_seconds / plain if plain > 0 else 1.0  # a probe's catch-up, in plain steps
        run = self._with_probes(lengths, states, steps_left,
                                math.ceil(self.policy.population_probe_interval * max(catch_up, 1.0)))
        self.last_run.update(zip(decode_ids, run))
        for st in states:
            st.steps_unverified += 1
        self.steps_since_verify += bool(decode_ids)
        self.length_histogram.update(run)
        self.num_steps_without_drafting += bool(decode_ids) and not any(run)
        return run

    def resume_charges(self, decode_ids: list[int], steps_left: list[int | None], resume_seconds: float) -> list[float]:
        """Per row, the seconds of a catch-up charged to this step if it drafts: none for a row that
        drafted at its last step; otherwise ``resume_seconds`` spread over the steps it can draft
        from here, at most ``probe_interval`` (the horizon a probe is taken to pay over). The
        drafter catches up on what it did not see (the prompt at a request's first draft, the
        steps it was off): measured 12-07 at c = 1 with the trained EAGLE-3, a first draft after
        length 0 took 21-24 ms against 6 ms for a plain step and 9.5 for a steady one-draft step,
        and the decision, which priced only the steady step, drafted where it lost (the 21:13
        grid's eagle3 c = 1, 0.91-0.96 of plain)."""
        interval = self.policy.probe_interval
        return [0.0 if self.last_run.get(s, 0) or not resume_seconds
                else resume_seconds / max(1, min(interval if left is None else left, interval))
                for s, left in zip(decode_ids, steps_left)]

    def _with_probes(self, lengths: list[int], states: list[RequestAcceptance],
                     steps_left: list[int | None], population_interval: int) -> list[int]:
        """``lengths`` with a probe (length 1) for each row at 0 that is due one, and, in a step that
        probes anyway, for each row at 0 past half its interval: the step runs the drafter for the
        first probe, so the others cost only their rows, and their next probes fall due together.
        Unaligned, 16 requests arriving a step apart each probe on a step of their own: with an
        interval of 32, one step in two runs the drafter for one row (the suspected cause of
        issue 27's eagle3 cell at concurrency 16; docs/benchmarks.md, the partial grid). A row with
        ``probe_interval`` steps or fewer left does not probe until no draft has been verified
        engine-wide for ``population_interval`` steps (the module docstring). While the engine
        warms up, every row at 0 probes."""
        if self.is_warming_up:
            return [1 if k == 0 and self.policy.ceiling else k for k in lengths]
        interval = self.policy.probe_interval
        is_stale = self.steps_since_verify >= population_interval
        can_use = [is_stale or left is None or left > interval for left in steps_left]
        if not self.policy.ceiling or not any(k == 0 and st.steps_unverified >= interval and use
                                              for k, st, use in zip(lengths, states, can_use)):
            return list(lengths)
        return [1 if k == 0 and 2 * st.steps_unverified >= interval and use else k
                for k, st, use in zip(lengths, states, can_use)]

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """What a decode row's verify showed (``proposed`` 0: it drafted nothing, nothing seen)."""
        state = self._state(seq_id)
        state.evidence.record(proposed, accepted)
        if proposed:
            state.steps_unverified = self.steps_since_verify = 0
            self.num_verifies += 1
            self.population.record(proposed, accepted)

    def forget(self, seq_id: int) -> None:
        self.requests.pop(seq_id, None)
        self.chosen.pop(seq_id, None)
        self.last_run.pop(seq_id, None)

    def stats(self) -> dict:
        return {"draft_length_histogram": [self.length_histogram[k] for k in range(self.policy.ceiling + 1)],
                "num_steps_without_drafting": self.num_steps_without_drafting,
                "num_draft_length_switches": self.num_switches,
                "population_acceptance": [round(p, 4) for p in self.population_estimate()]}
