"""What the start-up probe's phase timings give the step-cost model (``probe.py`` runs the
phases): the samples and their least-squares fit, the price of a verified draft and of a plain
step at each batch timed, and a one-row step's time by verified drafts. Pure: no I/O, no model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from statistics import median

from specray.errors import ConfigError
from specray.executor.adaptive import PRIOR_COST
from specray.executor.step_cost import StepCost, StepShape, fit_step_cost


@dataclass(frozen=True, slots=True)
class PhaseTiming:
    shape: StepShape  # the most common shape among the phase's timed steps
    seconds: float  # median step time of the steps of that shape
    draft_seconds: float  # median drafting time within them (0 for a plain step)


def phase_timing(steps: list[tuple[StepShape, float, float]]) -> PhaseTiming:
    """A phase's (shape, step seconds, drafting seconds) steps summed up: the medians over the
    steps of its most common shape (the drafter may propose fewer drafts in a step)."""
    shape = Counter(s for s, _, _ in steps).most_common(1)[0][0]
    kept = [(t, d) for s, t, d in steps if s == shape]
    return PhaseTiming(shape, median(t for t, _ in kept), median(d for _, d in kept))


def batch_phases(phases: dict[str, PhaseTiming]) -> list[tuple[PhaseTiming, PhaseTiming]]:
    """(plain, verify) at each batch the probe timed, batch 1 first, then by size."""
    sizes = sorted(int(name[6:]) for name in phases if name.startswith("plain_") and name[6:].isdigit())
    for size in sizes:
        if phases[f"plain_{size}"].shape.num_decode_rows != size:  # each batch's prices are keyed by its rows
            raise RuntimeError(f"the step-cost probe's plain phase at batch {size} ran "
                               f"{phases[f'plain_{size}'].shape.num_decode_rows} decode rows")
    return [(phases["plain_one"], phases["verify_one"])] + [(phases[f"plain_{s}"], phases[f"verify_{s}"])
                                                           for s in sizes]


def probe_samples(phases: dict[str, PhaseTiming]) -> list[tuple[StepShape, float]]:
    """The (shape, seconds) samples of the probe's phases: probe_shapes' six (at the largest
    batch), then the verify of one sequence and each smaller batch's plain, drafter-alone and
    verify samples; the drafter alone is the plain step of its rows plus the verify's drafting."""
    (plain_one, verify_one), *middle, (plain_many, verify_many) = batch_phases(phases)

    def drafter_alone(plain: PhaseTiming, verify: PhaseTiming) -> tuple[StepShape, float]:
        return replace(verify.shape, num_verify_rows=0), plain.seconds + verify.draft_seconds

    samples = [(plain_one.shape, plain_one.seconds), (plain_many.shape, plain_many.seconds),
               (phases["prefill"].shape, phases["prefill"].seconds),
               drafter_alone(plain_one, verify_one), drafter_alone(plain_many, verify_many),
               (verify_many.shape, verify_many.seconds), (verify_one.shape, verify_one.seconds)]
    for plain, verify in middle:
        samples += [(plain.shape, plain.seconds), drafter_alone(plain, verify), (verify.shape, verify.seconds)]
    return samples


def fit_probe(phases: dict[str, PhaseTiming]) -> StepCost:
    """The step cost the probe's phases fit in least squares. A feature that no probe step
    varies (the drafter's forwards under ngram, which runs none; verify rows where prompt lookup
    found no draft) keeps ``PRIOR_COST``'s value: a pull towards it worth 1e-6 steps, which moves
    the timed coefficients by about 1e-5 of themselves."""
    samples = probe_samples(phases)
    try:
        return fit_step_cost(samples)
    except ConfigError:  # the timings do not determine every coefficient
        return fit_step_cost(samples, prior=PRIOR_COST, prior_weight=1e-6)


def verify_slopes(phases: dict[str, PhaseTiming]) -> dict[int, float]:
    """Seconds per verified draft at each batch size the probe timed (decode rows -> slope): a
    verify phase's step over the plain phase's of the same rows, less its drafting, per verify
    row. A batch whose lookup proposed nothing (no verify row) has none."""
    out = {}
    for plain, verify in batch_phases(phases):
        rows = verify.shape.num_verify_rows
        if rows:
            extra = verify.seconds - plain.seconds - verify.draft_seconds
            out[verify.shape.num_decode_rows] = max(extra, 0.0) / rows
    return out


def plain_seconds(phases: dict[str, PhaseTiming]) -> dict[int, float]:
    """A plain step's seconds at each batch size the probe timed (decode rows -> seconds)."""
    return {plain.shape.num_decode_rows: plain.seconds for plain, _ in batch_phases(phases)}


def one_row_seconds(phases: dict[str, PhaseTiming]) -> dict[int, float]:
    """A one-row step's seconds by verified drafts (``OneRowVerify``'s seeds): the plain phase's,
    and each batch-1 verify phase's, drafting included (a phase whose lookup proposed nothing
    verified nothing: left out)."""
    out = {0: phases["plain_one"].seconds}
    for name in sorted(n for n in phases if n.startswith("verify_one")):
        verify = phases[name]
        if verify.shape.num_verify_rows:
            out[verify.shape.num_verify_rows] = verify.seconds
    return out
