"""bench_spec's bytes-based ideal (benchmarks/drafter_bytes.py), with literals: what a drafting
step reads, per method, and the ideal speedup it implies. The benchmark itself is not in the suite."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import drafter_bytes as db

DRAFTER = {"model.embed_tokens.weight": 1000, "model.layers.0.mlp.down_proj.weight": 300,
           "model.norm.weight": 4, "lm_head.weight": 500}


def test_autoregressive_drafters_read_their_layers_and_head_once_per_draft():
    # k forwards, each: 300 + 4 bytes of layers, 500 of its own head; the embedding is read by rows
    assert db.draft_step_bytes("draft_model", 3, DRAFTER, target_head=9999) == 3 * (304 + 500)
    assert db.draft_step_bytes("eagle3", 1, DRAFTER, target_head=9999) == 804


def test_block_drafters_read_once_per_step_with_the_target_head():
    dflash = {"fc.weight": 120, "layers.0.self_attn.q_proj.weight": 64, "norm.weight": 4}
    assert db.draft_step_bytes("dflash", 7, dflash, target_head=2000) == 120 + 64 + 4 + 2000


def test_ngram_has_no_weights_to_count():
    with pytest.raises(ValueError, match="'ngram' has no drafter weights"):
        db.forwards_per_step("ngram", 3)


def test_ideal_from_bytes():
    # 1 GB/s reads 2e6 bytes in 2 ms; AL 3 * 10 ms plain step / (2 + 13) ms = 2.0
    assert db.ideal_from_bytes(3.0, 10.0, 2_000_000, 1.0, 13.0) == pytest.approx(2.0)
    row = dict(acceptance_length=3.0, draft_bytes=2_000_000, verify_ms=13.0, decode_speedup=1.5)
    db.add_bytes_columns(row, 10.0, 1.0)
    assert row["ideal_bytes_speedup"] == pytest.approx(2.0) and row["bytes_efficiency"] == pytest.approx(0.75)


def test_checkpoints_on_disk(tmp_path):
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    target.mkdir()
    drafter.mkdir()
    # a tied target: its head is the embedding, 10 x 8 float32 = 320 bytes
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    save_file({"fc.weight": torch.zeros(8, 16), "norm.weight": torch.zeros(8, dtype=torch.bfloat16)},
              drafter / "model.safetensors")
    assert db.checkpoint_draft_bytes("dflash", 3, drafter, target) == 8 * 16 * 4 + 8 * 2 + 320
    (target / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="neither lm_head.weight nor a tied embedding"):
        db.checkpoint_draft_bytes("dflash", 3, drafter, target)


def test_mtp_counts_its_modules_inside_the_target_with_their_own_head():
    # DeepSeek-V3's layout: the module is layer L = 2 after the target's two; its shared_head.head is its head
    target = {"model.embed_tokens.weight": 1000, "model.layers.1.mlp.down_proj.weight": 300, "lm_head.weight": 500,
              "model.layers.2.eh_proj.weight": 80, "model.layers.2.mlp.down_proj.weight": 300,
              "model.layers.2.shared_head.head.weight": 500}
    module = db.mtp_tensors(target, num_layers=2)
    assert module == {"model.layers.2.eh_proj.weight": 80, "model.layers.2.mlp.down_proj.weight": 300,
                      "lm_head.weight": 500}
    assert db.draft_step_bytes("mtp", 3, module, target_head=500) == 3 * (380 + 500)
    # Qwen3-Next's layout: mtp.*, the target's head
    assert db.mtp_tensors({"mtp.fc.weight": 64, "model.layers.0.x": 9}, num_layers=1) == {"mtp.fc.weight": 64}


def test_summarize_takes_the_median_rounds_ratio_and_its_parts():
    # bench_drafters: per round, plain TPOT over the method's; the median round's parts give the bytes columns
    from benchmarks.bench_drafters import summarize

    plains = [{"tpot_ms": 10.0}, {"tpot_ms": 12.0}, {"tpot_ms": 10.0}]
    parts = [{"draft fwd": d, "draft head": 1.0, "sample": 0.0, "verify fwd": 12.0, "verify head": 1.0, "step": 20.0}
             for d in (3.0, 4.0, 5.0)]
    passes = [{"tpot_ms": 5.0, "parts": parts[0]}, {"tpot_ms": 4.0, "parts": parts[1]},
              {"tpot_ms": 8.0, "parts": parts[2]}]
    cell = summarize("dflash", 1, passes, plains, draft_bytes=2_000_000, gbps=1.0, acceptance_length=3.0)
    assert cell["round_ratios"] == [2.0, 3.0, 1.25] and cell["speedup"] == 2.0  # the median round: the first
    assert cell["draft_ms"] == 4.0 and cell["verify_ms"] == 13.0 and cell["bytes_ms"] == pytest.approx(2.0)
    # ideal B = 3 * 10 / (2 + 13) = 2.0, so eff B = 2.0 / 2.0
    assert cell["ideal_bytes"] == pytest.approx(2.0) and cell["eff_bytes"] == pytest.approx(1.0)
