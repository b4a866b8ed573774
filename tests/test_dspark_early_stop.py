"""DSpark's confidence early stop (``SpecConfig.dspark_confidence_threshold``): a sequence
proposes draft j only while the product of its confidence head's predictions for drafts
0..j stays at or above the threshold.

The checkpoint's confidence head is set so the stop is known: proj weight 0 and bias 0 make
every prediction sigmoid(0) = 0.5, so the products are 0.5, 0.25, 0.125, ...; with threshold
0.2 every step proposes exactly 2 drafts (0.25 >= 0.2 > 0.125), with threshold 0.6 none.

Under adaptive speculation without a fixed threshold the step plan carries one from rank 0's
cost model (λ c_verify_row, executor/adaptive.py): the drafts each step proposes are the ones
that threshold admits, and without the gate (a mutation) every row proposes k; at TP 2 both
ranks follow rank 0's threshold.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import make_checkpoint
from drafter_checkpoints import empty_pools, load, propose, write_dspark
from safetensors.torch import load_file, save_file

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.executor.step_cost import StepCost

PROMPTS = [list(range(3, 3 + n)) for n in (5, 61, 30)]  # prompt + 40 tokens crosses 32/64-token pages
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
K = 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark-stop")
    target = make_checkpoint("llama", root / "target", seed=3, num_hidden_layers=3)
    drafter = write_dspark(root / "dspark", target)
    w = load_file(drafter / "model.safetensors")
    w["confidence_head.proj.weight"] = torch.zeros_like(w["confidence_head.proj.weight"])
    w["confidence_head.proj.bias"] = torch.zeros_like(w["confidence_head.proj.bias"])
    save_file(w, drafter / "model.safetensors")
    return target, drafter


def engine(ckpt, method="dspark", threshold=None, page=32, tp=1, adaptive=False) -> EngineConfig:
    target, drafter = ckpt
    spec = SpecConfig(method=method, draft_model=str(drafter) if method else None, num_draft_tokens=K,
                      dspark_confidence_threshold=threshold, adaptive=adaptive)
    parallel = ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local", check_every_step=tp > 1,
                              timeout_s=60.0)
    return EngineConfig(model=str(target), kv=KVConfig(tokens_per_block=page, capacity_tokens=4096), spec=spec,
                        parallel=parallel)


@pytest.fixture(scope="module")
def plain(ckpt):
    with LLM(engine(ckpt, method=None)) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _run(config):
    with LLM(config) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    steps = sum(o.metrics["num_verify_steps"] for o in outs)
    return [o.token_ids for o in outs], drafted, steps


@pytest.mark.parametrize("page, tp", [(32, 1), (64, 1), (32, 2)])
def test_early_stop_is_lossless_and_proposes_up_to_the_known_stop(ckpt, plain, page, tp):
    """At TP 2 every rank must stop at the same draft (checked every step): the confidence
    head reads block outputs and a Markov embedding that every rank holds bitwise equal."""
    tokens, drafted, steps = _run(engine(ckpt, threshold=0.2, page=page, tp=tp))
    assert tokens == plain
    assert steps > 0 and drafted == 2 * steps  # 0.5 * 0.5 = 0.25 >= 0.2 > 0.125: drafts 0 and 1


def test_off_by_default_proposes_k_drafts_and_changes_nothing(ckpt, plain):
    assert SpecConfig(method="dspark").dspark_confidence_threshold is None
    tokens, drafted, steps = _run(engine(ckpt))
    assert tokens == plain
    assert steps > 0 and drafted == K * steps


def test_a_threshold_above_the_first_confidence_drafts_nothing(ckpt, plain):
    tokens, drafted, _ = _run(engine(ckpt, threshold=0.6))
    assert tokens == plain and drafted == 0


class FixedCost:
    """The adaptive controller's cost model held at literals (the step timings are not recorded),
    so the thresholds it sends depend on the acceptance seen only."""

    cost = StepCost(c_step=0.010, c_decode_row=0.003, c_verify_row=0.003)
    prior = cost

    def at(self, num_decode_rows):
        return self.cost

    def record(self, shape, seconds):
        pass

    def stats(self):
        return {}


class AtCeiling:
    """The length decision pinned at K (records and stats the controller's own)."""

    def __init__(self, controller):
        self.controller = controller

    def __getattr__(self, name):
        return getattr(self.controller, name)

    def decide(self, seq_ids, cost, steps_left=None, resume_seconds=0.0):
        self.controller.decide(seq_ids, cost, steps_left)  # keeps its probes' and histogram's bookkeeping
        return [K] * len(seq_ids)


def _run_gated(ckpt, is_gated=True):
    """Tokens, drafts proposed, the drafts the thresholds admit, decode steps and the controller's stats; one
    request, so each step with a decode row has one threshold and one proposal."""
    with LLM(engine(ckpt, adaptive=True)) as llm:
        adaptive = llm._engine.core.adaptive
        assert adaptive.confidence_gated  # dspark with a head and no fixed threshold
        adaptive.confidence_gated = is_gated
        adaptive.cost, adaptive.controller = FixedCost(), AtCeiling(adaptive.controller)
        sched = llm._engine.core.scheduler
        choose, thresholds = sched.choose_draft_lengths, []

        def spy(decoding):
            lengths = choose(decoding)
            if decoding:
                thresholds.append(adaptive.verify_threshold)
            return lengths

        sched.choose_draft_lengths = spy
        out = llm.generate(PROMPTS[1:2], PARAMS)[0]
        stats = adaptive.stats()
    # the confidences are all 0.5: draft j is verified while 0.5 ** (j + 1) >= the threshold
    admitted = sum(K if t is None else sum(0.5 ** (j + 1) >= t for j in range(K)) for t in thresholds)
    return out.token_ids, out.metrics["num_draft_tokens"], admitted, len(thresholds), stats


def test_adaptive_speculation_gates_the_verify_by_the_confidence_head(ckpt, plain):
    tokens, drafted, admitted, num_steps, stats = _run_gated(ckpt)
    assert tokens == plain[1]
    assert drafted == admitted  # every step proposed exactly what its threshold admits
    # K drafted per decode step (AtCeiling); what the head cut is counted, and it cut some
    assert 0 < stats["num_drafts_not_verified"] == K * num_steps - drafted
    # mutation: without the gate every step verifies all K drafts
    ungated_tokens, ungated, _, _, ungated_stats = _run_gated(ckpt, is_gated=False)
    assert ungated_tokens == plain[1] and ungated > drafted
    assert "num_drafts_not_verified" not in ungated_stats


def test_two_ranks_follow_rank_zeros_verify_threshold(ckpt, plain):
    """TP 2, tokens compared on every step: the threshold travels in the plan. (The cost model
    here is the measured one, so how much it cuts is not known in advance; the rule is the
    test above.)"""
    with LLM(engine(ckpt, tp=2, adaptive=True)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        stats = llm.stats().adaptive
    assert [o.token_ids for o in outs] == plain
    assert stats["num_drafts_not_verified"] >= 0 and sum(stats["draft_length_histogram"]) > 0


def test_sampled_requests_with_early_stop_keep_their_draft_probabilities_aligned(ckpt):
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    with LLM(engine(ckpt, threshold=0.2)) as llm:
        outs = llm.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert sum(o.metrics["num_draft_tokens"] for o in outs) == 2 * sum(o.metrics["num_verify_steps"] for o in outs)


def test_the_drafter_returns_each_sequences_own_length(ckpt):
    from checkpoints import load_reference
    from drafter_checkpoints import target_features

    from specray.comm.context import DistContext
    from specray.workers.worker import load_model

    target, drafter_dir = ckpt
    model = load_model(target, DistContext.single(), "float32")
    drafter = load("dspark", drafter_dir, model, k=K)
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64]
    features = target_features(model, load_reference(target), tokens, drafter.feature_layers)
    full, _ = propose(drafter, tokens, features, K, empty_pools(drafter, len(drafter.layers)))
    drafter.confidence_threshold = 0.2
    short = drafter.propose(*_batch(drafter, tokens, features))
    assert len(full) == K and short == [full[:2]]  # the same drafts, stopped after two


def _batch(drafter, tokens, features):
    from drafter_checkpoints import PAGE

    from specray.models.drafters.common import DraftBatch, DraftSeq

    pools = empty_pools(drafter, len(drafter.layers))
    table = list(range(pools[0].shape[0]))
    batch = DraftBatch([DraftSeq(list(tokens), 0, features, table)], K, pools, PAGE, torch.device("cpu"))
    return batch, lambda logits, j: logits.argmax(-1)


@pytest.mark.parametrize("spec, error", [
    (dict(method="dspark", dspark_confidence_threshold=1.0),
     r"dspark_confidence_threshold \(1.0\) must be in \(0, 1\)"),
    (dict(method="dspark", dspark_confidence_threshold=0.0), r"must be in \(0, 1\)"),
    (dict(method="dflash", dspark_confidence_threshold=0.5), r"applies to spec method 'dspark' only, not 'dflash'"),
])
def test_bad_thresholds_are_rejected(spec, error):
    with pytest.raises(ValueError, match=error):
        SpecConfig(**spec)


def test_a_checkpoint_without_a_confidence_head_is_rejected(ckpt, tmp_path):
    target, _ = ckpt
    drafter = write_dspark(tmp_path / "noconf", target)
    cfg = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps(dict(cfg, enable_confidence_head=False)))
    w = load_file(drafter / "model.safetensors")
    save_file({n: t for n, t in w.items() if not n.startswith("confidence_head")}, drafter / "model.safetensors")
    config = EngineConfig(model=str(target), kv=KVConfig(capacity_tokens=1024),
                          spec=SpecConfig(method="dspark", draft_model=str(drafter), dspark_confidence_threshold=0.5))
    with pytest.raises(ValueError, match="needs a confidence head, and drafter .* has none"):
        LLM(config)
