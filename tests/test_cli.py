"""`specray generate | bench` through main(argv): outputs, config mapping, errors, JSON."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from test_tokenizer import BYTES, make_tokenizer_json

from specray import LLM, EngineConfig, KVConfig, SamplingParams
from specray.cli import build_parser, engine_config_from_args, main

KV = ["--tokens-per-block", "16", "--kv-capacity-tokens", "1024"]
SUMMARY = re.compile(r"^(\d+) tokens in [\d.]+ s: [\d.]+ tok/s", re.M)


def printed_text(out: str) -> str:
    """What generate printed between the pool line and the summary line (it may hold newlines)."""
    start = out.index("\n") + 1
    end = out.rindex("\n", 0, len(out) - 1)
    return out[start:end]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def reference():
    """The engine the CLI runs for the KV flags above, used directly through the Python API."""
    with LLM(EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))) as llm:
        yield llm


def test_generate_prompt_ids_prints_the_engines_greedy_tokens(capsys, reference):
    prompt = [72, 101, 108, 108, 111, 44, 32]
    code, out, _ = run_cli(capsys, "generate", "--prompt-ids", ",".join(map(str, prompt)),
                           "--max-tokens", "12", "--ignore-eos", *KV)
    assert code == 0
    expected = reference.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    ids_line = next(line for line in out.splitlines() if line.startswith("output ids:"))
    assert [int(t) for t in ids_line.split(":")[1].split(",")] == expected
    assert SUMMARY.search(out).group(1) == "12"
    assert re.search(r"^target pool: page 16 tokens, 64 blocks", out, re.M)


def test_generate_prompt_text_goes_through_the_byte_tokenizer(capsys, reference):
    code, out, _ = run_cli(capsys, "generate", "--prompt", "hello", "--max-tokens", "10", "--ignore-eos", *KV)
    assert code == 0
    tokens = reference.generate([BYTES.encode("hello")], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    assert printed_text(out) == BYTES.decode(tokens)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint saved by transformers: no tokenizer.json."""
    from checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def test_generate_uses_the_checkpoints_tokenizer_json(capsys, tmp_path, hf_checkpoint):
    from tokenizers import Tokenizer

    checkpoint = shutil.copytree(hf_checkpoint, tmp_path / "with-tokenizer")
    tokenizer = Tokenizer.from_file(str(make_tokenizer_json(checkpoint)))
    code, out, _ = run_cli(capsys, "generate", "--model", str(checkpoint), "--prompt", "the drafts",
                           "--max-tokens", "6", "--ignore-eos", *KV)
    assert code == 0
    ids = tokenizer.encode("the drafts").ids
    with LLM(EngineConfig(model=str(checkpoint), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))) as llm:
        tokens = llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert printed_text(out) == tokenizer.decode(tokens, skip_special_tokens=True)
    assert SUMMARY.search(out).group(1) == "6"


def test_checkpoint_without_tokenizer_takes_ids_but_not_text(capsys, hf_checkpoint):
    code, out, _ = run_cli(capsys, "generate", "--model", str(hf_checkpoint), "--prompt-ids", "3,4,5",
                           "--max-tokens", "4", "--ignore-eos", *KV)
    assert code == 0
    assert out.splitlines()[1].startswith("output ids: ")  # no text line: nothing to decode with
    code, _, err = run_cli(capsys, "generate", "--model", str(hf_checkpoint), "--prompt", "hi", *KV)
    assert code == 2
    assert err.startswith("error: ") and "a text prompt needs a tokenizer" in err and "pass token ids" in err


@pytest.mark.parametrize("argv, rule", [
    (["generate", "--prompt-ids", "1,2", "--tokens-per-block", "24"], "tokens_per_block (24) must be a power of two"),
    (["generate", "--prompt-ids", "1,2", "--top-p", "0"], "top_p (0.0) must be in (0, 1]"),
    (["generate", "--prompt-ids", "1,2", "--max-tokens", "0"], "--max-tokens (0) must be >= 1 for specray generate"),
    (["generate", "--prompt-ids", "1,2", "--tp", "4", "--moe-tp", "2", "--moe-ep", "3"], "moe_ep_size (3) must divide tp_size (4)"),
    (["generate", "--prompt-ids", "1,2", "--kv-memory-fraction", "1.5"], "memory_fraction (1.5) must be in (0, 1]"),
    (["generate", "--prompt-ids", "1,2", "--spec", "dflash", "--force-accepted-tokens", "9"],
     "force_accepted_tokens (9.0) must be within [1, num_draft_tokens + 1 = 5]"),
    (["generate", "--prompt-ids", "1,x"], "'1,x' is not a comma-separated list of integers"),
    (["generate", "--prompt", "a", "--dtype", "float64"], "argument --dtype: invalid choice"),
    (["generate", "--model", "no-such-model", "--prompt-ids", "1"], "is neither a built-in model"),
    (["generate", "--prompt-ids", "1,400", *KV], "token id 400 is outside the vocabulary [0, 320)"),
    (["bench", "--output-len", "1"], "output_len (1) must be >= 2"),
    (["bench", "--batch-sizes", "1,0"], "batch_sizes [1, 0] must be a non-empty list"),
])
def test_bad_values_print_one_error_line_and_exit_2(capsys, argv, rule):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert rule in err
    assert "Traceback" not in err + out


def test_engine_flags_map_onto_the_config_dataclasses():
    args = build_parser().parse_args([
        "bench", "--model", "tiny-moe", "--tp", "4", "--moe-tp", "2", "--moe-ep", "2", "--launcher", "mp",
        "--allreduce", "one_shot", "--tokens-per-block", "32", "--kv-capacity-tokens", "4096",
        "--kv-memory-fraction", "0.25", "--dtype", "bfloat16", "--spec", "draft_model", "--draft-model", "tiny-llama",
        "--num-draft-tokens", "3", "--force-accepted-tokens", "2.5",
    ])
    config = engine_config_from_args(args)
    assert (config.model, config.dtype, config.device) == ("tiny-moe", "bfloat16", "cpu")
    p = config.parallel
    assert (p.tp_size, p.moe_tp_size, p.moe_ep_size, p.launcher, p.allreduce) == (4, 2, 2, "mp", "one_shot")
    assert (config.kv.tokens_per_block, config.kv.capacity_tokens, config.kv.memory_fraction) == (32, 4096, 0.25)
    s = config.spec
    assert (s.method, s.draft_model, s.num_draft_tokens, s.force_accepted_tokens) == ("draft_model", "tiny-llama", 3, 2.5)


def test_bench_writes_one_row_per_batch_size(capsys, tmp_path):
    path = tmp_path / "out" / "bench.json"
    code, out, _ = run_cli(capsys, "bench", "--batch-sizes", "1,3", "--input-len", "9", "--output-len", "4",
                           "--warmup", "0", "--json", str(path), "--no-progress", *KV)
    assert code == 0
    report = json.loads(path.read_text())
    assert set(report) == {"engine", "bench", "geometry", "rows"}
    assert report["engine"]["kv"]["tokens_per_block"] == 16
    assert report["geometry"]["target"]["num_blocks"] == 64
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert {"tok_s_per_request", "total_tok_s", "ttft_p50_ms", "tpot_p50_ms", "tpot_p90_ms"} <= set(row)
        assert row["num_output_tokens"] == 4 * row["batch"]  # ignore_eos: every request runs to output_len
        assert row["tok_s_per_request"] == pytest.approx(1000.0 / row["tpot_p50_ms"])
        assert row["tpot_p50_ms"] <= row["tpot_p90_ms"]
    header = next(line for line in out.splitlines() if line.lstrip().startswith("batch"))
    assert header.split() == ["batch", "tok/s/req", "total", "tok/s", "TTFT", "p50", "ms", "TPOT", "p50", "ms",
                              "TPOT", "p90", "ms"]


def test_python_dash_m_specray_runs_generate():
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "specray", "generate", "--prompt-ids", "5,6,7", "--max-tokens", "3",
                             "--ignore-eos", *KV], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert SUMMARY.search(result.stdout).group(1) == "3"


def test_generate_and_chat_on_the_real_model(capsys, monkeypatch):
    import io

    with LLM(EngineConfig(model="smollm2-135m", kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))) as llm:
        expected = llm.generate("The capital of France is", SamplingParams(max_tokens=8, ignore_eos=True))[0]
        first = llm.chat([{"role": "user", "content": "Hi, I am Ada."}], SamplingParams(max_tokens=12))[0]
        second = llm.chat([{"role": "user", "content": "Hi, I am Ada."}, {"role": "assistant", "content": first.text},
                           {"role": "user", "content": "Who am I?"}], SamplingParams(max_tokens=12))[0]
    real = ["--model", "smollm2-135m", *KV]
    code, out, _ = run_cli(capsys, "generate", "--prompt", "The capital of France is", "--max-tokens", "8",
                           "--ignore-eos", *real)
    assert code == 0 and printed_text(out) == expected.text and " Paris" in expected.text
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi, I am Ada.\n\nWho am I?\n/exit\nnever read\n"))
    code, out, err = run_cli(capsys, "chat", "--max-tokens", "12", *real)
    assert code == 0
    answers = out.split("\n", 1)[1]  # after the pool line: one answer per turn, the history kept
    assert answers == f"{first.text}\n{second.text}\n"
    assert "/exit to quit" in err and len(SUMMARY.findall(err)) == 2
