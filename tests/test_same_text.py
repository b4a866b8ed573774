"""The same-text harness (specray/same_text*.py): its statistics with literals, and the
harness on a tiny target: speculative greedy output equals plain (100%), and a configuration
paired with itself differs by 0 within its interval."""

from __future__ import annotations

import json

import pytest
from checkpoints import make_checkpoint

from specray.cli import main
from specray.config import EngineConfig, SpecConfig
from specray.models.drafter_presets import write_drafter_for
from specray.same_text import compare, parse_variant, run_prefixes, summarize
from specray.same_text_stats import (Interval, bootstrap_mean, first_difference, paired_difference, percentile,
                                     share_equal, step_time_s)

# ------------------------------------------------------------------ pure statistics


def test_percentile_interpolates_between_ranks():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 1.0) == 4.0
    assert percentile([10.0], 0.3) == 10.0
    with pytest.raises(ValueError, match="empty"):
        percentile([], 0.5)


def test_bootstrap_of_constant_values_is_a_point_and_of_spread_values_brackets_the_mean():
    assert bootstrap_mean([2.0, 2.0, 2.0]) == Interval(2.0, 2.0, 2.0)
    spread = bootstrap_mean([1.0, 2.0, 3.0, 4.0, 5.0], num_resamples=2000, seed=1)
    assert spread.mean == 3.0 and 1.0 < spread.low < 3.0 < spread.high < 5.0
    assert bootstrap_mean([1.0, 5.0], seed=3) == bootstrap_mean([1.0, 5.0], seed=3)  # seeded: reproducible
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_mean([])


def test_paired_difference_of_identical_sides_is_zero_and_of_a_shift_is_the_shift():
    same = paired_difference([1.5, 2.0, 3.25], [1.5, 2.0, 3.25])
    assert same == Interval(0.0, 0.0, 0.0) and same.contains(0.0)
    shifted = paired_difference([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])
    assert shifted == Interval(0.5, 0.5, 0.5) and not shifted.contains(0.0)
    with pytest.raises(ValueError, match="one value per prefix"):
        paired_difference([1.0], [1.0, 2.0])


def test_share_equal_and_first_difference():
    assert share_equal([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.5
    assert share_equal([[1, 2]], [[1, 2]]) == 1.0
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2]) is None
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_step_time_counts_decode_steps():
    # 9 tokens after the first in 0.09 s (tpot 0.01) over 3 decode steps: 0.03 s a step
    assert step_time_s(dict(num_output_tokens=10, tpot_s=0.01, num_decode_steps=3)) == pytest.approx(0.03)
    assert step_time_s(dict(num_output_tokens=10, tpot_s=0.01)) == pytest.approx(0.01)  # plain: a step a token


def test_variants_split_environment_from_engine_flags():
    v = parse_variant("SPECRAY_DRAFT_KERNEL_PAGE_SIZES=32 num-draft-tokens=5")
    assert v.env == (("SPECRAY_DRAFT_KERNEL_PAGE_SIZES", "32"),)
    assert v.flags == ("--num-draft-tokens", "5")
    assert parse_variant("") == parse_variant("  ").__class__("", (), ())
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_variant("num-draft-tokens")

# ------------------------------------------------------------------ the harness on a tiny target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("st") / "target", seed=3, num_hidden_layers=4)


PREFIXES = [[5, 17, 3, 99, 5, 17, 3, 99, 5, 17], [7, 7, 42, 11, 300, 2, 7, 7, 42], [1, 2, 3, 1, 2, 3, 1, 2]]


def test_speculative_outputs_equal_plain_and_a_config_paired_with_itself_differs_by_zero(target):
    base = EngineConfig(model=str(target), dtype="float32")
    spec = EngineConfig(model=str(target), dtype="float32", spec=SpecConfig(method="ngram", num_draft_tokens=3,
                                                                            prompt_lookup_min=2))
    plain, _ = run_prefixes(base, PREFIXES, 16)
    a = summarize(run_prefixes(spec, PREFIXES, 16)[0], plain)
    b = summarize(run_prefixes(spec, PREFIXES, 16)[0], plain)
    assert a["share_equal_to_plain"] == 1.0 and not a["first_mismatch"]
    assert a["acceptance_length"].low <= a["acceptance_length"].mean <= a["acceptance_length"].high
    assert len(a["acceptance_per_position"]) == 3
    diff = compare(a, b)["acceptance_length_difference"]
    assert diff.mean == 0.0 and diff.contains(0.0)


def test_cli_same_text_pairs_dflash_draft_pages_32_and_64(target, tmp_path, capsys):
    drafter = write_drafter_for(target, "dflash", tmp_path / "dflash", seed=1)
    prefixes = tmp_path / "prefixes.jsonl"
    prefixes.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PREFIXES))
    out = tmp_path / "report.json"
    code = main(["bench", "--same-text", "--model", str(target), "--dtype", "float32", "--spec", "dflash",
                 "--draft-model", str(drafter), "--num-draft-tokens", "3", "--tokens-per-block", "64",
                 "--prefixes", str(prefixes), "--output-len", "12", "--json", str(out),
                 "--variant-a", "SPECRAY_DRAFT_KERNEL_PAGE_SIZES=32", "--variant-b", "SPECRAY_DRAFT_KERNEL_PAGE_SIZES=64"])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    assert [r["share_equal_to_plain"] for r in report["reports"]] == [1.0, 1.0]
    assert [r["page_sizes"]["draft"] for r in report["reports"]] == [32, 64]  # the variants took effect
    diff = report["comparison"]["acceptance_length_difference"]
    # DFlash's drafts do not depend on the page size of its pool: the same acceptance, prefix by prefix
    assert diff["mean"] == 0.0 and diff["low"] <= 0.0 <= diff["high"]
    assert "equal to plain, token for token: 100.0%" in text and "contains 0" in text


def test_cli_same_text_without_speculation_is_an_error(target, capsys):
    assert main(["bench", "--same-text", "--model", str(target), "--prefixes", "x.jsonl"]) == 2
    assert "pass --spec METHOD" in capsys.readouterr().err
