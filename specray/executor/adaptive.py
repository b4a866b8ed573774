"""Adaptive speculation on rank 0: each step's draft lengths, from a cost model refreshed by
the step timings this rank measures and each request's acceptance (issue 27).

The scheduler asks ``choose`` for the lengths of the sequences that decode this step (never
its prefill rows) before it grants pages; after the step the engine hands back the plan, the
drafts each row verified, the new tokens and the step's wall time on rank 0 (plan sent to
the followers, forward, collectives, sampling: what the ranks together took), and this
records the step's shape and time in the online fit of its batch class (``StepCostByBatch``: a
verified draft costs 0.9 ms at batch 1 and 3.9 ms at batch 4 here, so one fit cannot price both;
a one-row step's verify is priced per length from its own timings, ``executor/one_row.py``)
and each row's acceptance.

The prior (the fit's starting point, counted as ``prior_weight`` steps) is the start-up probe's
fit (``executor/probe.py``: every rank timed on a short fixed schedule of steps before the
first request); ``PRIOR_COST``, a rough CPU figure, stands in only when the probe is off
(``SpecConfig.adaptive_probe=False``) or cannot run. A request's acceptance starts from the
engine-wide estimate of the requests before it (``draft_controller.py``).

With a confidence head (dspark, ``confidence_gated``) the lengths chosen are what each row drafts,
and the head decides, draft by draft, what is verified: ``verify_threshold`` = λ c_verify_row,
with λ the modelled goodput of the chosen lengths (tokens per second) and c_verify_row the
seconds a verified draft adds. A draft whose predicted probability of being reached is below it
is expected to add fewer tokens than its verify row's time is worth at that rate (the draft
itself is already computed: a block drafter drafts every position in one forward).
"""

from __future__ import annotations

import logging
from collections import deque
from statistics import median

from specray.executor.draft_controller import DraftLengthController, DraftLengthPolicy
from specray.executor.draft_length import draft_forwards, draft_rows, goodput, per_draft_seconds
from specray.executor.one_row import OneRowVerify
from specray.executor.step_cost import StepCost, StepShape
from specray.executor.step_cost_by_batch import StepCostByBatch
from specray.workers.plan import StepPlan

log = logging.getLogger(__name__)

# seconds per unit: a step's fixed cost, a target row (plain or verified draft), a prompt
# token, a drafter row and a drafter forward; of the order this CPU measures for tiny models
PRIOR_COST = StepCost(c_step=5e-3, c_decode_row=2e-3, c_verify_row=1e-3, c_prefill_token=0.5e-3,
                      c_draft_row=0.2e-3, c_draft_forward=1e-3)


class AdaptiveDraftLengths:
    def __init__(self, method: str, ceiling: int, *, prior: StepCost = PRIOR_COST, prior_source: str = "fixed",
                 probe_note: str = "", policy: DraftLengthPolicy | None = None, window: int = 256,
                 confidence_gated: bool = False, verify_slopes: dict[int, float] | None = None,
                 plain_seconds: dict[int, float] | None = None, one_row_seconds: dict[int, float] | None = None):
        """``prior_source``: "probed" (measured at start-up) or "fixed" (``PRIOR_COST``);
        ``probe_note``: how the probe went, for the one start-up log line; ``confidence_gated``:
        the drafter's confidence head decides what is verified (see the module docstring);
        ``verify_slopes``: seconds per verified draft by decode rows, as the probe measured them;
        ``plain_seconds``: a plain step's seconds by decode rows, the same (each batch class's
        prior, ``StepCostByBatch``);
        ``one_row_seconds``: a one-row step's seconds by verified drafts, as the probe measured
        them (``OneRowVerify``'s seeds)."""
        self.method, self.ceiling, self.prior_source = method, ceiling, prior_source
        self.confidence_gated = confidence_gated
        self.verify_threshold: float | None = None  # this step's, when confidence-gated
        self.num_drafts_not_verified = 0  # drafted by the chosen length, cut by the confidence head
        self.controller = DraftLengthController(policy or DraftLengthPolicy(ceiling=ceiling), method)
        # refit every 8 steps: the solve costs ~0.1 ms of Python, and 8 steps are 3% of the window.
        # Two rows keep a table by the drafts both verify, where the drafting does not follow the
        # longest row (two rows of 2 drafts and one of 4 and one of 0 then draft alike)
        two_rows = OneRowVerify(2 * ceiling) if draft_forwards(method, 2) == draft_forwards(method, 1) else None
        self.cost = StepCostByBatch(prior, verify_slopes=verify_slopes, plain_seconds=plain_seconds, window=window,
                                    refit_every=8, one_row=OneRowVerify(ceiling, seeds=one_row_seconds),
                                    two_rows=two_rows, per_draft=lambda cost: per_draft_seconds(cost, method))
        self._planned: dict[int, int] = {}  # the last choice: sequence id -> length
        self._was_drafting: dict[int, bool] = {}  # each decoding sequence: did it draft at its last step
        self.num_steps_not_fitted = 0  # steps whose drafter caught up (``is_fitted``)
        # per resumed row, what a catch-up step took over its modelled time (the last 32)
        self._resumes: deque[float] = deque(maxlen=32)
        slopes = ", ".join(f"{1e3 * v:.3g} ms at {n}" for n, v in sorted((verify_slopes or {}).items()))
        plain = ", ".join(f"{1e3 * v:.3g} ms at {n}" for n, v in sorted((plain_seconds or {}).items()))
        log.info("adaptive speculation (%s, lengths 0..%d): %s prior: %s%s%s", method, ceiling, prior.describe(),
                 probe_note or prior_source, f"; per verified draft {slopes} decode rows" if slopes else "",
                 f"; a plain step {plain} decode rows" if plain else "")

    def choose(self, decoding) -> list[int]:
        """The draft lengths of the sequences that decode this step (scheduler hook)."""
        ids = [seq.seq_id for seq in decoding]
        cost = self.cost.at(len(ids))
        lengths = self.controller.decide(ids, cost, [seq.params.max_tokens - len(seq.output_ids) for seq in decoding],
                                         resume_seconds=self.resume_seconds)
        self._planned = dict(zip(ids, lengths))
        self.verify_threshold = None
        if self.confidence_gated and any(lengths):
            rate = goodput([self.controller.estimates(s) for s in ids], lengths, cost, self.method)
            self.verify_threshold = min(1.0, rate * cost.c_verify_row)
        return lengths

    def observe(self, plan: StepPlan, num_drafts: list[int] | None, tokens: list, seconds: float) -> None:
        """Record a step: its shape and time, each decode row's acceptance; forget finished ones."""
        for sid in plan.finished:
            self.controller.forget(sid)
            self._was_drafting.pop(sid, None)
        if not plan.seq_ids:
            return
        for sid, proposed, new in zip(plan.seq_ids, num_drafts or [0] * len(plan.seq_ids), tokens):
            if sid in self._planned and new is not None and new != []:  # a decode row that sampled
                accepted = len(new) - 1 if isinstance(new, list) else 0
                self.controller.record(sid, proposed, min(accepted, proposed))
                if self.confidence_gated:
                    self.num_drafts_not_verified += max(self._planned[sid] - proposed, 0)
        shape = step_shape(self.method, plan, self._planned, num_drafts)
        if self.is_fitted(self._planned):
            self.cost.record(shape, seconds)
        else:
            self.num_steps_not_fitted += 1
            resumed = sum(1 for sid, length in self._planned.items() if length and not self._was_drafting.get(sid))
            if resumed:  # the catch-up: what the step took over the model's price of its shape
                over = seconds - self.cost.at(shape.num_decode_rows).predict(shape)
                self._resumes.append(max(over, 0.0) / resumed)
        self._was_drafting.update((sid, length > 0) for sid, length in self._planned.items())
        self._planned = {}

    def is_fitted(self, planned: dict[int, int]) -> bool:
        """Whether a step's time goes into the cost model: not where a row drafts that did not
        draft at its last step. A drafter that runs a model first catches up on what it has not
        seen (the prompt at a request's first draft, or the steps it was off), work the model has
        no feature for and the decision does not choose by. Timed in, it is charged to the
        drafts: measured 12-07 (dflash, every draft accepted, 4 requests), two such steps of
        557 and 336 ms (three prompts prefilled beside them) raised a verified draft from 3.9 to
        7.2 ms, and the batch ran at length 0 from its fourth step on. Prompt lookup runs no
        model and has nothing to catch up."""
        if not draft_rows(self.method, 1):
            return True
        return all(self._was_drafting.get(sid, False) for sid, length in planned.items() if length)

    @property
    def resume_seconds(self) -> float:
        """A resumed row's catch-up, the median of the last 32 measured (0 before any; never for
        prompt lookup, which has nothing to catch up)."""
        return median(self._resumes) if self._resumes else 0.0

    def stats(self) -> dict:
        gated = {"num_drafts_not_verified": self.num_drafts_not_verified} if self.confidence_gated else {}
        return {**self.controller.stats(), **gated, "step_cost": {**self.cost.stats(), "prior": self.prior_source,
                                                          "prior_cost": self.cost.prior.as_dict(),
                                                          "num_steps_not_fitted": self.num_steps_not_fitted,
                                                          "resume_s": self.resume_seconds}}


def step_shape(method: str, plan: StepPlan, planned: dict[int, int], num_drafts: list[int] | None) -> StepShape:
    """What a step computed, in the cost model's units: the rows given a draft length
    (``planned``) decode, verifying the drafts the ranks proposed (``num_drafts``); any other
    row is a prefill row (or a chunk of one)."""
    decode_rows = verify_rows = num_draft_rows = prefill_tokens = longest = 0
    for sid, ids, proposed in zip(plan.seq_ids, plan.input_ids, num_drafts or [0] * len(plan.seq_ids)):
        length = planned.get(sid)
        if length is None:
            prefill_tokens += len(ids)
            continue
        decode_rows += 1
        verify_rows += proposed
        num_draft_rows += draft_rows(method, length)
        longest = max(longest, length)
    return StepShape(num_decode_rows=decode_rows, num_verify_rows=verify_rows, num_prefill_tokens=prefill_tokens,
                     num_draft_rows=num_draft_rows, num_draft_forwards=draft_forwards(method, longest))
