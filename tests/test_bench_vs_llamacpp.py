"""The llama.cpp anchor benchmark's pure parts (benchmarks/bench_vs_llamacpp.py), without
llama.cpp: the TPOT and agreement arithmetic with literals, the skip when llama-cpp-python is
absent, and the GGUF writer that gives both engines a preset's weights (read back by specray,
token-exact against the preset's own checkpoint). The benchmark itself is not part of the suite."""

from __future__ import annotations

import sys

import pytest

from benchmarks import bench_vs_llamacpp as bench
from benchmarks import llamacpp_peer
from benchmarks.anchor_weights import write_preset_gguf
from benchmarks.own_thread import on_own_thread
from specray import LLM, EngineConfig, KVConfig, SamplingParams
from specray.models.presets import materialize


def test_tpot_is_the_decode_span_over_the_tokens_after_the_first():
    # first token at 0.5 s (prefill), then 3 more tokens by 0.8 s: 0.3 s / 3 = 100 ms
    assert llamacpp_peer.decode_tpot_ms([0.5, 0.6, 0.7, 0.8]) == pytest.approx(100.0)
    # drafted tokens arrive together: the span still counts every token after the first
    assert llamacpp_peer.decode_tpot_ms([1.0, 1.2, 1.2, 1.2, 1.4]) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="at least 2 token timestamps, got 1"):
        llamacpp_peer.decode_tpot_ms([1.0])


def test_agreement_counts_identical_outputs_and_the_agreeing_prefix():
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    b = [[1, 2, 3, 4], [5, 6, 0, 8]]  # the second differs from its third token on
    assert bench.agreement(a, b) == dict(identical=0.5, prefix=pytest.approx((1.0 + 0.5) / 2))
    assert bench.agreement([[1, 2]], [[1, 2, 3, 4]]) == dict(identical=0.0, prefix=0.5)  # a shorter output
    with pytest.raises(ValueError, match="equally long, non-empty lists of outputs, got 1 and 2"):
        bench.agreement([[1]], [[1], [2]])


def test_tok_s_ratios_and_verdicts():
    run = dict(tpot_ms=20.0, ttft_ms=100.0, tok_s=40.0, tokens_per_step=2.0)
    best = {"specray": {"plain": dict(run, tpot_ms=24.0), "ngram k=3": dict(run, tok_s=90.0),
                        "ngram k=5": dict(run, tok_s=80.0)},
            "llamacpp": {"plain": run, "ngram k=3": dict(run, tok_s=45.0), "ngram k=5": dict(run, tok_s=50.0)},
            "transformers": {"plain": dict(tpot_ms=72.0)}}
    rows = {r["metric"]: r for r in bench.table_rows(best)}
    assert rows["BS1 TPOT ms, plain"]["ratio"] == pytest.approx(1.2)  # 24 / 20 ms
    assert rows["speedup over plain, ngram k=3"]["specray"] == pytest.approx(2.25)  # 90 / 40 tok/s
    assert rows["tok/s, ngram k=5"]["ratio"] == pytest.approx(1.6)  # 80 / 50
    best_k = rows["tok/s, ngram, each engine's best k"]  # specray's k=3 against llama.cpp's k=5
    assert (best_k["specray"], best_k["llamacpp"]) == (90.0, 50.0)
    assert bench.verdicts(list(rows.values())) == [
        "BS1 TPOT specray/llama.cpp 1.20 on f32 (target <= 1.25): met",
        "BS1 TPOT transformers/specray 3.00 (target >= 2.5): met",
        "ngram tok/s specray/llama.cpp 1.80 (target >= 1.5): met",
    ]


def test_without_llama_cpp_it_says_how_to_install_it_and_skips(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "run `make anchors`" in out and "about 11 minutes" in out and "skipped" in out


def test_quick_and_bad_arguments():
    args = bench.parse_args(["--quick", "--threads", "1"])
    assert (args.num_prompts, args.output_len, args.rounds, args.threads) == (2, 32, 1, 1)
    assert (args.ngram_k, args.lookup, args.spec_factor) == ((3, 5, 7), (1, 4), 2.0)
    spec = bench.specray_spec("ngram k=5", args.lookup, args.spec_factor)
    assert (spec.num_draft_tokens, spec.prompt_lookup_min, spec.prompt_lookup_spec_factor) == (5, 1, 2.0)
    assert not bench.specray_spec("plain", args.lookup, args.spec_factor).is_enabled
    with pytest.raises(SystemExit):
        bench.parse_args(["--output-len", "1"])


def test_preset_written_to_gguf_decodes_the_same_tokens(tmp_path):
    """The writer's names, q/k interleave and vocabulary, read back by specray's GGUF loader: greedy
    output equal to the preset's own checkpoint (same float32 weights, same arithmetic)."""
    checkpoint = materialize("tiny-llama")
    path = write_preset_gguf(checkpoint, tmp_path / "tiny-llama.F32.gguf")
    prompts = [[5, 17, 42, 99, 3], [250, 7, 7, 7]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = []
    for model in (str(checkpoint), str(path)):
        with LLM(EngineConfig(model=model, kv=KVConfig(tokens_per_block=16, capacity_tokens=256))) as llm:
            outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]
    assert len(outputs[0][0]) == 12


def test_on_own_thread_returns_the_value_raises_the_error_and_leaves_no_thread():
    import threading

    callers = []

    def work(x, *, y):
        callers.append(threading.current_thread())
        return x + y

    assert on_own_thread(work, 2, y=3) == 5
    assert callers[0] is not threading.current_thread() and not callers[0].is_alive()

    def fail():
        raise ValueError("bad value 7")

    with pytest.raises(ValueError, match="bad value 7"):
        on_own_thread(fail)
