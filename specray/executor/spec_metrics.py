"""Speculative-decoding metrics, per request and aggregated over requests.

A verify step is a step in which the sequence verified at least one draft: a step whose
drafter proposed nothing (ngram where no n-gram matches) is a plain decode step and counts
nowhere here, as vLLM counts ``num_drafts`` only for sequence-steps that proposed drafts.

- acceptance length (AL): tokens emitted per verify step (accepted drafts + 1 bonus); 1.0
  when no step verified a draft (every step emitted its one token);
- per-position acceptance rate: for draft position i (1..k), the fraction of verify steps
  that accepted draft i (so it never increases with i; a step that proposed fewer than i
  drafts counts as not accepting draft i, as vLLM divides by ``num_drafts``);
- acceptance rate: accepted drafts over proposed drafts (``num_draft_tokens``, which is
  below steps * k when the drafter proposed fewer than k);
- histogram: how many verify steps accepted 0, 1, ..., k drafts;
- tokens per decode step: tokens emitted per target forward that decoded the sequence, the
  steps without drafts included (so at most AL): what the speedup follows when a drafter
  often proposes nothing;
- TTFT and TPOT come from the engine's timestamps; tok/s per request = 1 / median TPOT.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def request_metrics(accepted_counts: list[int], k: int, draft_counts: list[int] | None = None,
                    num_decode_steps: int | None = None) -> dict:
    """Metrics of one request from the drafts it accepted (and proposed, k each when None) at
    each verify step, and the steps that decoded it (the verify steps when None)."""
    steps = len(accepted_counts)
    accepted = sum(accepted_counts)
    proposed = sum(draft_counts) if draft_counts is not None else steps * k
    decode_steps = steps if num_decode_steps is None else num_decode_steps
    return dict(
        num_decode_steps=decode_steps,
        tokens_per_decode_step=(accepted + decode_steps) / decode_steps if decode_steps else 1.0,
        num_verify_steps=steps,
        num_draft_tokens=proposed,
        num_accepted_tokens=accepted,
        acceptance_length=(accepted + steps) / steps if steps else 1.0,
        acceptance_per_position=[sum(n >= i for n in accepted_counts) / steps if steps else 0.0
                                 for i in range(1, k + 1)],
        acceptance_histogram=[accepted_counts.count(n) for n in range(k + 1)],
    )


def aggregate(metrics: list[dict]) -> dict:
    """Totals over requests (each a RequestOutput.metrics dict); AL is weighted by verify steps."""
    out: dict = {"num_requests": len(metrics)}
    ttfts = [m["ttft_s"] for m in metrics if "ttft_s" in m]
    tpots = [m["tpot_s"] for m in metrics if m.get("tpot_s")]
    if ttfts:
        out["ttft_s_mean"] = statistics.fmean(ttfts)
    if tpots:
        out["tpot_s_median"] = statistics.median(tpots)
        out["tok_per_s_per_request"] = 1.0 / out["tpot_s_median"]
    spec = [m for m in metrics if "num_verify_steps" in m]
    if not spec:
        return out
    steps = sum(m["num_verify_steps"] for m in spec)
    accepted = sum(m["num_accepted_tokens"] for m in spec)
    proposed = sum(m["num_draft_tokens"] for m in spec)
    decode_steps = sum(m["num_decode_steps"] for m in spec)
    k = len(spec[0]["acceptance_histogram"]) - 1
    hist = [sum(m["acceptance_histogram"][n] for m in spec) for n in range(k + 1)]
    out.update(
        num_verify_steps=steps,
        num_draft_tokens=proposed,
        num_accepted_tokens=accepted,
        acceptance_length=(accepted + steps) / steps if steps else 1.0,
        acceptance_rate=accepted / proposed if proposed else 0.0,
        num_decode_steps=decode_steps,
        tokens_per_decode_step=(accepted + decode_steps) / decode_steps if decode_steps else 1.0,
        acceptance_histogram=hist,
        acceptance_per_position=[sum(hist[i:]) / steps if steps else 0.0 for i in range(1, k + 1)],
    )
    return out


@dataclass(slots=True)
class SpecCounters:
    """Cumulative counters over every request, as vLLM names them: ``num_drafts`` counts the
    sequence-steps that verified at least one draft, ``accepted_per_position[i]`` those that
    accepted draft i + 1 (so it never increases with i)."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = [0] * self.k

    def record(self, accepted: int, proposed: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
