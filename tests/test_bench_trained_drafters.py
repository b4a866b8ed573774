"""benchmarks/bench_trained_drafters.py: its rows, verdicts and argument checks (the benchmark itself
runs the real model for minutes: `python -m benchmarks.bench_trained_drafters`)."""

from __future__ import annotations

import pytest

from benchmarks import bench_trained_drafters as bench


def row(method: str, k: int, al: float, speedup: float) -> dict:
    return dict(method=method, k=str(k), al_mean=al, speedup=speedup)


def test_verdicts_take_each_drafters_best_k_for_each_target():
    report = [row("plain", 0, 1.0, 1.0), row("ngram", 3, 1.7, 1.6),
              row("eagle3", 3, 2.2, 1.9), row("eagle3", 7, 2.6, 1.5), row("dflash", 5, 1.4, 1.1)]
    assert bench.verdicts(report) == [
        "dflash: best AL 1.40 at k=5 (target >= 2.5): NOT met; best speedup 1.10x at k=5 (target >= 1.8x): NOT met",
        "eagle3: best AL 2.60 at k=7 (target >= 2.5): met; best speedup 1.90x at k=3 (target >= 1.8x): met",
    ]
    assert "not measured" in bench.verdicts(report[:2])[0]


def test_rows_and_arguments(tmp_path, capsys):
    (tmp_path / "e3").mkdir()
    (tmp_path / "e3" / "config.json").write_text("{}")
    args = bench.parse_args(["--eagle3", str(tmp_path / "e3"), "--ks", "3,5"])
    assert [(m, k) for m, k, _, _ in bench.configs(args)] == [
        ("plain", None), ("ngram", 3), ("ngram", 5), ("eagle3", 3), ("eagle3", 5)]
    spec = bench.configs(args)[-1][2]
    assert (spec.method, spec.draft_model, spec.num_draft_tokens) == ("eagle3", str(tmp_path / "e3"), 5)
    with pytest.raises(SystemExit):
        bench.parse_args(["--dflash", str(tmp_path / "missing")])
    assert "config.json missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--pages"])
    assert "give --dflash" in capsys.readouterr().err
