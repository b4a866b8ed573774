"""Qwen3-Next's own MTP module (``mtp.*``, a gated-attention block with the shared-expert MoE,
its KV as one more layer of the target's pool) drafting for the hybrid target, and n-gram
drafting on it at TP 2: greedy tokens equal transformers' plain greedy decoding, the drafts are
accepted (a verify commits every acceptance count, not only n = 0), sharded runs accept exactly
what the unsharded run accepts, and preemption leaves no slot or page behind.

The checkpoint (``make_qwen3_next_with_mtp``) is built so that its MTP module predicts the target
well while the linear layers' state still decides tokens: a skipped commit is caught here by the
tokens (the mutation test), as test_hybrid_rollback.py catches it by the state itself. The MTP
maths is held against speculators' Qwen3-Next MTP layer in test_mtp.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoints import load_reference, make_qwen3_next_with_mtp, reference_greedy
from hybrid import assert_no_slot_held, hybrid_config
from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig
from specray.workers import worker as worker_module

# around 16- and 32-token pages (15, 16, 17, 33) and, with a 48-token step budget, prefilled in
# several chunks, one of them past the chunked rule's 64 (100)
PROMPT_LENS = (15, 16, 17, 33, 100)
NEW_TOKENS = 72
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    directory = make_qwen3_next_with_mtp(tmp_path_factory.mktemp("qwen3_next_mtp"))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    reference = load_reference(directory)
    return directory, prompts, [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]


def mtp_config(directory, k: int = 3, tp: int = 1, page: int = 16, **parallel) -> EngineConfig:
    cfg = hybrid_config(directory, tp, kv=KVConfig(tokens_per_block=page, capacity_tokens=4096),
                        spec=SpecConfig(method="mtp", num_draft_tokens=k), max_num_batched_tokens=48)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def run(config: EngineConfig, prompts) -> list:
    with LLM(config) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert_no_slot_held(llm)
        geometry = llm.geometry
    # one-model drafter: no draft pool; its block is one more paged layer beside the two
    # full-attention layers, and the linear layers keep state slots
    assert list(geometry) == ["target", "state"] and geometry["target"].num_layers == 3
    return outs


def accepted(outs) -> list[list[int]]:
    return [o.metrics["acceptance_histogram"] for o in outs]


@pytest.fixture(scope="module")
def tp1_k3(case):
    directory, prompts, _ = case
    return run(mtp_config(directory), prompts)


def test_mtp_keeps_the_greedy_tokens_and_its_drafts_are_accepted(case, tp1_k3):
    _, _, expected = case
    assert [o.token_ids for o in tp1_k3] == expected
    histogram = [sum(h[n] for h in accepted(tp1_k3)) for n in range(4)]
    # every acceptance count occurs, so every committed position (0..3) is exercised
    assert all(count > 0 for count in histogram), histogram
    assert all(o.metrics["acceptance_length"] > 1.5 for o in tp1_k3), [o.metrics["acceptance_length"] for o in tp1_k3]


@pytest.mark.parametrize("k, page", [(1, 32), (7, 16)])
def test_mtp_is_lossless_at_other_draft_lengths_and_pages(case, k, page):
    directory, prompts, expected = case
    outs = run(mtp_config(directory, k, page=page), prompts)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_a_skipped_state_commit_changes_the_tokens(case, monkeypatch):
    # the mutation: every verify leaves the linear layers at the last verified position, accepted
    # or not; the test above must be able to see that
    directory, prompts, expected = case
    monkeypatch.setattr(worker_module, "commit_accepted", lambda *args, **kwargs: None)
    outs = run(mtp_config(directory), prompts)
    assert [o.token_ids for o in outs] != expected


@pytest.mark.parametrize("moe_tp, moe_ep", [(2, 1), (1, 2)])
def test_mtp_at_tp2_accepts_what_tp1_accepts(case, tp1_k3, moe_tp, moe_ep):
    directory, prompts, expected = case
    outs = run(mtp_config(directory, tp=2, moe_tp_size=moe_tp, moe_ep_size=moe_ep), prompts)
    assert [o.token_ids for o in outs] == expected
    assert accepted(outs) == accepted(tp1_k3)


def test_ngram_at_tp2_keeps_the_greedy_tokens(case):
    # repeated prompts give prompt lookup something to find, so verify rows occur at TP 2 too
    directory, prompts, _ = case
    reference = load_reference(directory)
    repeated = [p[:6] * 4 for p in prompts[:3]]
    spec = SpecConfig(method="ngram", num_draft_tokens=3)
    with LLM(hybrid_config(directory, tp=2, spec=spec, max_num_batched_tokens=48)) as llm:
        outs = llm.generate(repeated, GREEDY)
        assert_no_slot_held(llm)
    assert [o.token_ids for o in outs] == [reference_greedy(reference, p, NEW_TOKENS) for p in repeated]
    assert sum(o.metrics["num_verify_steps"] for o in outs) > 0


def test_mtp_under_preemption_keeps_the_tokens_and_frees_every_slot(case):
    # a verify row reserves pages for k drafts: 12 pages of 16 preempt three sequences of
    # 33-100 prompt tokens; a preempted sequence recomputes its state and its MTP KV
    directory, prompts, expected = case
    cfg = dataclasses.replace(mtp_config(directory), kv=KVConfig(tokens_per_block=16, capacity_tokens=192),
                              max_num_seqs=3)
    with LLM(cfg) as llm:
        outs = llm.generate(prompts[2:], GREEDY)
        assert_no_slot_held(llm)
    assert [o.token_ids for o in outs] == expected[2:]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_the_preset_carries_its_mtp_module():
    from specray.models.presets import materialize

    reference = load_reference(materialize("tiny-qwen3-next"))
    prompts = [[256] + list(b"Hybrid models keep a state per sequence"), [256] + list(b"def f(x):")]
    spec = SpecConfig(method="mtp", num_draft_tokens=3)
    with LLM(EngineConfig(model="tiny-qwen3-next", kv=KVConfig(capacity_tokens=1024), max_num_seqs=2,
                          spec=spec)) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        assert_no_slot_held(llm)
        assert llm.geometry["target"].num_layers == 2  # its one full-attention layer and the MTP block
    assert [o.token_ids for o in outs] == [reference_greedy(reference, p, 32) for p in prompts]
    assert all(o.metrics["num_verify_steps"] > 0 for o in outs)


def test_a_preset_cached_before_it_had_its_mtp_module_is_written_anew(tmp_path, monkeypatch):
    # a cache written by an older specray (tiny-qwen3-next without mtp.*) would otherwise fail
    # `--spec mtp` with missing tensors: a preset is reused only while its config says what the preset says
    import json

    from safetensors.torch import load_file, save_file

    from specray.models.presets import materialize

    monkeypatch.setenv("SPECRAY_CACHE", str(tmp_path))
    path = materialize("tiny-qwen3-next")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["mtp_num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(cfg))
    weights = load_file(path / "model.safetensors")
    save_file({n: t for n, t in weights.items() if not n.startswith("mtp.")}, str(path / "model.safetensors"))
    assert materialize("tiny-qwen3-next") == path
    assert json.loads((path / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    assert "mtp.fc.weight" in load_file(path / "model.safetensors")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert materialize("tiny-qwen3-next") == path and (path / "model.safetensors").stat().st_mtime_ns == mtime
