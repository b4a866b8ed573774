"""Adaptive speculation in the engine (SpecConfig(adaptive=True), issue 27): greedy output
equal to plain decoding whatever lengths are chosen (batch 1, 4, 16; every method; the
controller's own choice and a forced policy that mixes lengths inside one batch); pause and
resume (drafting forced off for steps 10-40): the drafts after resuming are the drafts of a
run that never paused, drafting with the target itself is accepted >= 99% right after
resuming, and a mutation (the drafter told it is current while its KV or features were not
kept) makes both checks fail; a length-0 step is a plain step for every method.

The decision's scheduling contract (prefill rows outside it, pages only for the chosen
length, bounded switches) is tests/test_adaptive_schedule.py. The target is test_spec.py's
tiny Llama; the drafters are drafter_presets.write_drafter_for's (draft_model: the target's
early-exit copy, heads: seeded random weights).
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from checkpoints import make_checkpoint

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.models.drafter_presets import write_drafter_for
from specray.workers.spec_step import SpecRunner

METHODS = ("ngram", "draft_model", "eagle3", "dflash", "dspark", "mtp")
FEATURE_METHODS = ("eagle3", "dflash", "dspark", "mtp")
# 16 prompts of lengths 5..50; the second half repeat a short pattern so ngram finds matches
PROMPTS = [list(range(3, 3 + 5 + 3 * i)) if i % 2 == 0 else [7, 8, 9, 10, 11] * (1 + i // 2) for i in range(16)]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    target = make_checkpoint("llama", root / "target", seed=3, num_hidden_layers=3)
    drafters = {m: write_drafter_for(target, m, root / m) for m in METHODS if m != "ngram"}
    return target, drafters


def config(ckpt, method=None, k=3, draft_model=None, **spec) -> EngineConfig:
    target, drafters = ckpt
    if method is not None and method != "ngram":
        draft_model = draft_model or str(drafters[method])
    s = SpecConfig(method=method, draft_model=draft_model, num_draft_tokens=k,
                   adaptive=method is not None, **spec)
    return EngineConfig(model=str(target), kv=KVConfig(tokens_per_block=32, capacity_tokens=16384), spec=s)


class Forced:
    """A draft-length policy for tests, in place of the controller's decision: ``rule(step,
    seq_id)`` per decoding row, ``step`` counting the scheduler's steps from 0; the rest
    (acceptance records, stats) is the wrapped controller's."""

    def __init__(self, rule, controller=None):
        self.rule, self.controller, self.step, self.choices = rule, controller, 0, []

    def __getattr__(self, name):
        return getattr(self.controller, name)

    def decide(self, seq_ids, cost, steps_left=None, resume_seconds=0.0):
        lengths = [self.rule(self.step, sid) for sid in seq_ids]
        self.choices.append(dict(zip(seq_ids, lengths)))
        self.step += 1
        return lengths


def run(ckpt, method, prompts, params, rule=None, log_dir=None, monkeypatch=None, **kw):
    """Token ids, the rank's draft log by sequence ([L, drafts, accepted] rows) and the policy."""
    if log_dir is not None:
        log_dir.mkdir()
        monkeypatch.setenv("SPECRAY_TEST_DRAFTS_DIR", str(log_dir))
    forced = Forced(rule) if rule is not None else None
    with LLM(config(ckpt, method, **kw)) as llm:
        core = llm._engine.core
        if forced is not None:
            forced.controller = core.adaptive.controller
            core.adaptive.controller = forced
        outs = llm.generate(prompts, params)
        assert core.allocator.num_free == core.allocator.num_blocks  # nothing leaked
        if core.draft_allocator is not None:
            assert core.draft_allocator.num_free == core.draft_allocator.num_blocks
    drafts = defaultdict(list)
    path = log_dir / "rank0.drafts" if log_dir is not None else None
    for line in (path.read_text().splitlines() if path is not None and path.exists() else []):
        sid, length, proposed, accepted = json.loads(line)
        if sid >= 0:  # not the start-up probe's sequences (executor/probe.py): requests only
            drafts[sid].append((length, proposed, accepted))
    return [o.token_ids for o in outs], dict(drafts), forced


@pytest.fixture(scope="module")
def plain(ckpt):
    with LLM(config(ckpt)) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def mixed(step, sid):  # lengths 0..3 side by side in every batch of 4 or more, changing every step
    return (sid + step) % 4


@pytest.mark.parametrize("policy", ["controller", "mixed"])
@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_plain_decoding_under_every_policy(ckpt, plain, method, batch, policy):
    tokens, _, forced = run(ckpt, method, PROMPTS[:batch], PARAMS, rule=mixed if policy == "mixed" else None)
    assert tokens == plain[:batch]
    if forced is not None and batch > 1:  # the batch really mixed lengths, a 0 beside drafting rows
        assert any(len(set(c.values())) == min(batch, 4) for c in forced.choices)


def pause_rule(k):
    return lambda step, sid: 0 if 10 <= step < 40 else k


PAUSE_PROMPTS = [list(range(3, 40)), [7, 8, 9, 10, 11] * 6]
PAUSE_PARAMS = SamplingParams(max_tokens=90, ignore_eos=True)
# the target drafting for itself emits k + 1 = 5 tokens a step: 45 before the pause, 30 in it, 8 steps after
TARGET_PARAMS = SamplingParams(max_tokens=130, ignore_eos=True)


def pause_and_resume(ckpt, method, tmp_path, monkeypatch, params=PAUSE_PARAMS, **kw):
    """(paused run's drafts after resuming, the never-paused run's drafts at the same (seq, L))."""
    k = kw.pop("k", 3)
    tokens, paused, _ = run(ckpt, method, PAUSE_PROMPTS, params, pause_rule(k), tmp_path / "paused",
                            monkeypatch, k=k, **kw)
    ref_tokens, ref, _ = run(ckpt, method, PAUSE_PROMPTS, params, lambda step, sid: k, tmp_path / "ref",
                             monkeypatch, k=k, **kw)
    assert tokens == ref_tokens
    after, ref_at = {}, {}
    for sid, rows in paused.items():
        # the pause is the one gap of ~30 tokens between consecutive drafts (30 plain steps)
        gaps = [rows[i + 1][0] - rows[i][0] for i in range(len(rows) - 1)]
        resume = max(range(len(gaps)), key=gaps.__getitem__) + 1
        assert resume >= 8 and gaps[resume - 1] >= 30 and len(rows) - resume >= 8, (sid, rows)
        after[sid] = rows[resume:]
        ref_by_length = {r[0]: r for r in ref[sid]}
        ref_at[sid] = [ref_by_length.get(r[0]) for r in after[sid]]
    return after, ref_at


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "dflash"])
def test_drafts_after_a_pause_are_those_of_a_run_that_never_paused(ckpt, method, tmp_path, monkeypatch):
    after, ref_at = pause_and_resume(ckpt, method, tmp_path, monkeypatch)
    compared = 0
    for sid in after:
        # the first draft after resuming is the one a stale drafter gets wrong; the never-paused
        # run drafted at that length too (random heads reject nearly everything: one token a step)
        assert ref_at[sid][0] is not None or method == "draft_model", (sid, after[sid][0])
        for row, ref_row in zip(after[sid], ref_at[sid]):
            if ref_row is not None:
                assert row == ref_row, (sid, row, ref_row)
                compared += 1
    assert compared >= 20


def _accepted_right_after(after, num_rows=8):
    rows = [r for sid in after for r in after[sid][:num_rows]]
    return sum(r[2] for r in rows), sum(len(r[1]) for r in rows)


def test_the_target_as_its_own_draft_model_accepts_right_after_resuming(ckpt, tmp_path, monkeypatch):
    target, _ = ckpt
    after, _ = pause_and_resume(ckpt, "draft_model", tmp_path, monkeypatch, TARGET_PARAMS, k=4,
                                draft_model=str(target))
    accepted, drafted = _accepted_right_after(after)
    assert drafted >= 60 and accepted >= 0.99 * drafted, (accepted, drafted)


def stale_while_paused(monkeypatch):
    """Mutation: a plain step tells the drafter it is current (its cache holds every position
    it does not draft from) without writing its KV or keeping the target's features: the bug of
    TensorRT-LLM #16888, a drafter left stale by a step that skipped drafting."""
    keep = SpecRunner.observe_plain

    def observe_stale(self, plan, tokens, *args, **kwargs):
        keep(self, plan, tokens, *args, **kwargs)
        for sid in plan.seq_ids:
            if sid in self.tokens and sid not in plan.partial:
                # the drafter's cache "holds" every position but the last one it needs to draft:
                # the fed token (a draft model), or the newest feature (eagle3 and the rest)
                kept = self.features[sid]  # the chunks of features since its last draft
                self.consumed[sid] = len(self.tokens[sid]) - 1 - (1 if kept else 0)
                self.features[sid] = [kept[-1][-1:]] if kept else []

    monkeypatch.setattr(SpecRunner, "observe_plain", observe_stale)
    # nor does it write the drafter's KV where the prefix cache asked it to catch up (plan.catch_up)
    monkeypatch.setattr(SpecRunner, "_catch_up", lambda self, seq_ids: None)


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "dflash"])
def test_mutation_a_drafter_left_stale_while_paused_fails_the_comparison(ckpt, method, tmp_path, monkeypatch):
    stale_while_paused(monkeypatch)
    after, ref_at = pause_and_resume(ckpt, method, tmp_path, monkeypatch)
    differ = [row != ref for sid in after for row, ref in zip(after[sid], ref_at[sid]) if ref is not None]
    assert differ and any(differ[:4]), "a stale drafter drafted as a current one: the comparison cannot see it"


def test_mutation_a_stale_target_draft_is_rejected_right_after_resuming(ckpt, tmp_path, monkeypatch):
    target, _ = ckpt
    stale_while_paused(monkeypatch)
    after, _ = pause_and_resume(ckpt, "draft_model", tmp_path, monkeypatch, TARGET_PARAMS, k=4,
                                draft_model=str(target))
    accepted, drafted = _accepted_right_after(after)
    assert accepted < 0.99 * drafted, (accepted, drafted)


@pytest.mark.parametrize("method", METHODS)
def test_a_step_at_length_zero_runs_no_speculative_machinery(ckpt, method, monkeypatch):
    """Issue 27 item 3: a step whose decoding rows all draft 0 is a plain step for every method
    (the speculative runner's execute, which drafts, scores k + 1 rows and verifies row by row,
    never runs), and the drafter still catches up: the output stays plain decoding's."""
    calls = []
    execute = SpecRunner.execute

    def spy(self, plan):
        calls.append(any(plan.num_drafts))
        return execute(self, plan)

    monkeypatch.setattr(SpecRunner, "execute", spy)
    prompts, params = PAUSE_PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True)
    tokens, _, forced = run(ckpt, method, prompts, params, rule=lambda step, sid: 3 if step % 3 == 0 else 0)
    with LLM(config(ckpt)) as llm:
        assert tokens == [o.token_ids for o in llm.generate(prompts, params)]
    assert all(calls), "a step without drafts went through the speculative runner"
    assert sum(1 for c in forced.choices if c and not any(c.values())) >= 10


def test_stats_metrics_and_bench_report_the_chosen_lengths(ckpt, tmp_path):
    """The controller's own choices, counted the same in ``LLM.stats()``, ``/metrics`` and
    ``specray bench`` (its JSON rows and table)."""
    from specray import cli
    from specray.serve.metrics import ServerMetrics

    with LLM(config(ckpt, "ngram")) as llm:
        outs = llm.generate(PROMPTS[:4], PARAMS)
        stats = llm.stats().adaptive
        text = ServerMetrics("m", stats=llm.stats).render().decode()
    hist = stats["draft_length_histogram"]
    assert len(hist) == 4 and sum(hist) == sum(o.metrics["num_decode_steps"] for o in outs)
    assert stats["step_cost"]["num_step_timings"] > 0 and stats["num_steps_without_drafting"] >= 0
    assert f'specray:spec_decode_draft_length_count{{model_name="m"}} {float(sum(hist))}' in text
    assert (f'specray:spec_decode_num_steps_without_drafting_total{{model_name="m"}} '
            f'{float(stats["num_steps_without_drafting"])}') in text
    target, _ = ckpt
    code = cli.main(["bench", "--model", str(target), "--spec", "ngram", "--adaptive", "--num-draft-tokens", "3",
                     "--input-len", "8", "--output-len", "8", "--batch-sizes", "1,2", "--warmup", "0",
                     "--no-progress", "--json", str(tmp_path / "b.json")])
    assert code == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    # one timed call per row: its decode rows by length; 7 tokens after the prefill's, 1 to 4 a step
    assert all(2 * r["batch"] <= sum(r["draft_length_histogram"]) <= 7 * r["batch"] for r in rows)
    assert all(0 <= r["num_steps_without_drafting"] <= 7 for r in rows)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_two_ranks_follow_rank_zeros_lengths(ckpt, plain, method):
    """TP 2 (mp launcher, tokens compared on every step): the lengths rank 0 chooses travel in
    the plan, and both ranks run the same plain or speculative step from it."""
    cfg = config(ckpt, method)
    cfg = EngineConfig(model=cfg.model, kv=cfg.kv, spec=cfg.spec,
                       parallel=ParallelConfig(tp_size=2, launcher="mp", check_every_step=True, timeout_s=60.0))
    with LLM(cfg) as llm:
        outs = llm.generate(PROMPTS[:4], PARAMS)
        stats = llm.stats().adaptive
    assert [o.token_ids for o in outs] == plain[:4]
    assert sum(stats["draft_length_histogram"]) > 0
