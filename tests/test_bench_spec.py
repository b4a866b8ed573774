"""The SmolLM2 speculative benchmark's arithmetic (benchmarks/spec_humaneval.py), with literals:
speedup, decode speedup, the ideal from measured step times, efficiency and the verdicts. The
benchmark itself loads a dozen engines and is not part of the suite (its --quick run takes
minutes on 2 cores)."""

from __future__ import annotations

import pytest

from benchmarks.spec_humaneval import finish_row, verdicts
from specray import SpecConfig

PLAIN = dict(tok_s=20.0, tpot_ms=40.0, tokens=[[1, 2, 3]], round_tok_s=[20.0, 16.0])


def test_ideal_and_efficiency_from_step_times():
    spec = SpecConfig(method="ngram", num_draft_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    row = finish_row(spec, dict(tok_s=30.0, tpot_ms=25.0, tokens=[[1, 2, 3]], tokens_per_step=2.0,
                                draft_ms=5.0, verify_ms=45.0, round_tok_s=[30.0, 20.0]), PLAIN)
    assert row["speedup"] == 1.5 and row["decode_speedup"] == 1.6  # 30/20 tok/s; 40/25 ms
    assert row["round_speedup"] == [1.5, 1.25]  # each round against plain's same round
    assert row["ideal_speedup"] == pytest.approx(1.6)  # 2 tokens per step * 40 ms / (5 + 45) ms
    assert row["efficiency"] == pytest.approx(1.0)
    assert row["lossless"] is True and (row["method"], row["k"], row["force"]) == ("ngram", 3, "-")


def test_forced_rows_are_not_checked_for_losslessness():
    spec = SpecConfig(method="dflash", draft_model="d", num_draft_tokens=3, force_accepted_tokens=3.0)
    row = finish_row(spec, dict(tok_s=40.0, tpot_ms=20.0, tokens=[[9]], tokens_per_step=3.0,
                                draft_ms=10.0, verify_ms=70.0, round_tok_s=[40.0, 32.0]), PLAIN)
    assert "lossless" not in row and row["force"] == "3"
    assert row["ideal_speedup"] == pytest.approx(1.5)  # 3 * 40 / 80
    assert row["efficiency"] == pytest.approx(2.0 / 1.5)


def test_verdicts_name_the_rows_that_miss():
    rows = [dict(method="ngram", k=3, force="-", batch=1, speedup=1.2, efficiency=0.95, lossless=True,
                 round_speedup=[1.2, 1.1]),
            dict(method="eagle3", k=6, force="6", batch=4, speedup=2.0, efficiency=0.8)]
    assert verdicts(rows) == [
        "ngram k=3 batch 1: 1.20x plain (target >= 1.5x): NOT met (round by round: 1.20x, 1.10x)",
        "efficiency >= 0.9 of ideal: NOT met by eagle3 k=6 force 6 batch 4: 0.80",
        "lossless (ngram outputs == plain outputs): True",
    ]
