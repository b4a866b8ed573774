"""n-gram (prompt lookup) drafting: the matching rule with literals, the config and CLI, and
the engine: lossless against plain greedy decoding on the tiny presets, drafts and metrics
exactly as the matching rule predicts on the plain output, no draft pool, no page leaks.

The presets have random weights, and random models fall into loops, so their greedy
continuations repeat: the drafter finds real matches and some are accepted (nothing is forced).
"""

from __future__ import annotations

import pytest
import torch

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.executor.scheduler import Scheduler, Sequence
from specray.executor.spec_metrics import aggregate, request_metrics
from specray.workers.verify import accept_rejection, one_hot_draft_probs
from specray.kv.allocator import BlockAllocator
from specray.kv.agreement import RankReport, decide
from specray.kv.geometry import KVLayout
from specray.kv.page_size import choose_draft_page_size
from specray.models.drafters.ngram import find_ngram_drafts

LOOKUP = dict(prompt_lookup_min=2, prompt_lookup_max=4)
MAX_TOKENS = 64
CODE = list(b"def fib(n):\n    return n\n")
# prompt + 64 tokens crosses 32- and 64-token pages; the last prompt is a continuation fed back (below)
BASE_PROMPTS = [CODE, list(range(100, 161)), list(b"Hello world")]


# ---- the matching rule ------------------------------------------------------------------

@pytest.mark.parametrize("tokens, min_n, max_n, k, drafts", [
    ([1, 2, 3, 4], 1, 4, 3, []),                           # the last token never occurred before
    ([9], 1, 1, 3, []),                                    # nothing earlier at all
    ([1, 2, 3, 1, 2], 3, 4, 5, []),                        # only a 2-gram repeats: below min
    ([1, 2, 3, 4, 1, 2], 2, 2, 2, [3, 4]),                 # the tokens after the match, cut at k
    ([1, 2, 3, 1, 2], 2, 3, 7, [3, 1, 2]),                 # cut at the sequence's end
    ([5, 1, 2, 9, 3, 1, 2, 8, 7, 3, 1, 2], 2, 3, 4, [8, 7, 3, 1]),  # the 3-gram wins over the 2-gram
    ([5, 1, 2, 9, 3, 1, 2, 8, 7, 3, 1, 2], 2, 2, 4, [9, 3, 1, 2]),  # capped at 2: the earliest 2-gram
    ([1, 2, 5, 1, 2, 6, 1, 2], 2, 2, 3, [5, 1, 2]),        # equal lengths: the earliest occurrence
    ([7, 7, 7, 7, 7], 1, 3, 5, [7, 7]),                    # a match may overlap the suffix
])
def test_find_ngram_drafts(tokens, min_n, max_n, k, drafts):
    assert find_ngram_drafts(tokens, min_n, max_n, k) == drafts


@pytest.mark.parametrize("min_n, factor, drafts", [
    (1, None, [8, 7, 3, 1, 2]),  # no factor: up to k (5), cut at the sequence's end
    (1, 1.0, [8, 7, 3]),         # the 3-gram [3, 1, 2] matched: at most 1.0 * 3 drafts
    (1, 1.5, [8, 7, 3, 1]),      # floor(1.5 * 3) = 4
    (1, 0.3, []),                # floor(0.3 * 3) = 0: no drafts, a plain step
    (2, 2.0, [8, 7, 3, 1, 2]),   # 2.0 * 3 = 6 > k: k caps
])
def test_the_spec_factor_caps_the_drafts_by_the_match_length(min_n, factor, drafts):
    tokens = [5, 1, 2, 9, 3, 1, 2, 8, 7, 3, 1, 2]
    assert find_ngram_drafts(tokens, min_n, 3, 5, factor) == drafts
    assert find_ngram_drafts([1, 2, 3, 1], 1, 3, 5, 2.0) == [2, 3]  # a 1-gram match: at most 2


def test_one_hot_drafts_are_accepted_with_the_target_probability():
    """q one-hot at d: accept d w.p. p(d), else draw from p without d, so the first emitted
    token follows p (4000 draws: 0.03 is about 4 standard errors)."""
    assert one_hot_draft_probs([2, 0], 3).tolist() == [[0, 0, 1], [1, 0, 0]]
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    gen = torch.Generator().manual_seed(0)
    first = torch.zeros(3)
    for _ in range(4000):
        n, bonus = accept_rejection(p, one_hot_draft_probs([1], 3), [1], gen)
        first[1 if n else bonus] += 1
    assert torch.allclose(first / 4000, p[0], atol=0.03)


# ---- metrics and page accounting with drafts of any length --------------------------------

def test_metrics_count_only_the_steps_that_verified_drafts():
    # three verify steps that proposed 3, 1 and 2 drafts (k = 3) and accepted 2, 0 and 1
    # ... out of 5 decode steps: the other two found no draft
    m = request_metrics([2, 0, 1], 3, [3, 1, 2], num_decode_steps=5)
    assert (m["num_verify_steps"], m["num_draft_tokens"], m["num_accepted_tokens"]) == (3, 6, 3)
    assert m["tokens_per_decode_step"] == 1.6  # (3 accepted + 5 tokens the target drew) / 5 forwards
    assert m["acceptance_length"] == 2.0  # (3 accepted + 3 bonus) / 3 steps
    assert m["acceptance_per_position"] == [2 / 3, 1 / 3, 0.0]  # over all 3 steps, as vLLM divides
    assert m["acceptance_histogram"] == [1, 1, 1, 0]
    none = request_metrics([], 3, [], num_decode_steps=3)
    assert (none["num_verify_steps"], none["num_draft_tokens"], none["acceptance_length"]) == (0, 0, 1.0)
    total = aggregate([dict(m), dict(none)])
    assert (total["acceptance_length"], total["acceptance_rate"], total["tokens_per_decode_step"]) == (2.0, 0.5, 1.375)


def test_scheduler_rolls_back_the_pages_of_short_and_missing_drafts():
    target = BlockAllocator(16)
    sched = Scheduler(target, 8, max_num_seqs=4, max_num_batched_tokens=1024, num_draft_tokens=4)
    seq = Sequence(0, list(range(15)), 15, SamplingParams(max_tokens=50), seed=0)
    sched.add(seq)
    sched.schedule()  # prefill 15 tokens + 4 lookahead: 3 pages of 8
    sched.finish_step([[100]], [0])
    assert sched.schedule().num_drafts == [4]  # at most k
    sched.finish_step([[101]], [0])  # the drafter found nothing: a plain decode step
    assert seq.num_computed == 16 and seq.accepted_counts == [] and len(seq.block_table) == 2
    assert sched.schedule().truncated == {0: (2, 0)}
    sched.finish_step([[1, 2, 102]], [2])  # two drafts proposed, both accepted, plus the bonus
    assert seq.num_computed == 19 and seq.accepted_counts == [2] and seq.draft_counts == [2]
    assert target.num_free + len(seq.block_table) == 16


# ---- config, CLI, geometry --------------------------------------------------------------

@pytest.mark.parametrize("spec, rule", [
    (dict(prompt_lookup_min=4, prompt_lookup_max=2), r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    (dict(prompt_lookup_min=0, prompt_lookup_max=2), r"prompt_lookup_min \(0\) must be an integer >= 1"),
    (dict(prompt_lookup_max=0), r"prompt_lookup_min \(0\) must be an integer >= 1"),
    (dict(draft_model="tiny-llama"), r"draft_model \('tiny-llama'\) must be unset"),
    (dict(prompt_lookup_spec_factor=0), r"prompt_lookup_spec_factor \(0\) must be > 0"),
    (dict(prompt_lookup_spec_factor=-1.5), r"prompt_lookup_spec_factor \(-1.5\) must be > 0"),
])
def test_bad_ngram_config_is_rejected(spec, rule):
    with pytest.raises(ValueError, match=rule):
        SpecConfig(method="ngram", **spec)


def test_prompt_lookup_defaults_follow_vllm():
    s = SpecConfig(method="ngram")
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (5, 5)
    s = SpecConfig(method="ngram", prompt_lookup_max=3)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (3, 3)
    s = SpecConfig(method="ngram", prompt_lookup_min=2)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (2, 2)
    with pytest.raises(ValueError, match="apply to spec method 'ngram' only, not 'eagle3'"):
        SpecConfig(method="eagle3", prompt_lookup_min=2)
    with pytest.raises(ValueError, match=r"prompt_lookup_spec_factor \(2.0\) apply to spec method 'ngram' only"):
        SpecConfig(method="eagle3", prompt_lookup_spec_factor=2.0)
    assert SpecConfig(method="ngram").prompt_lookup_spec_factor is None  # vLLM's ngram: up to k always


def test_cli_flags(capsys):
    from specray.cli import build_parser, engine_config_from_args, main

    args = build_parser().parse_args(["bench", "--spec", "ngram", "--num-draft-tokens", "5",
                                      "--prompt-lookup-min", "2", "--prompt-lookup-max", "4",
                                      "--prompt-lookup-spec-factor", "1.5"])
    s = engine_config_from_args(args).spec
    assert (s.method, s.num_draft_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 5, 2, 4)
    assert s.prompt_lookup_spec_factor == 1.5
    code = main(["generate", "--prompt-ids", "1,2", "--spec", "ngram", "--prompt-lookup-min", "3",
                 "--prompt-lookup-max", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "prompt_lookup_min (3) must be <= prompt_lookup_max (2)" in err


def test_the_geometry_has_no_draft_pool():
    assert choose_draft_page_size("ngram", 64, []) is None
    report = RankReport(rank=0, node="n", budget_bytes=1 << 20, target_layout=KVLayout(2, 2, 16),
                        target_kernels={"paged_attention": frozenset({32, 64})})
    assert decide([report], KVConfig(tokens_per_block=64), "ngram", "float32").keys() == {"target"}


# ---- the engine -------------------------------------------------------------------------

def config(model="tiny-llama", k=3, page=32, capacity=8192, parallel=None, spec=True, **lookup) -> EngineConfig:
    s = SpecConfig(method="ngram", num_draft_tokens=k, **(lookup or LOOKUP)) if spec else SpecConfig()
    return EngineConfig(model=model, kv=KVConfig(tokens_per_block=page, capacity_tokens=capacity),
                        parallel=parallel or ParallelConfig(), spec=s)


def expected_drafting(prompt: list[int], output: list[int], max_tokens: int, k: int, min_n: int = 2,
                      max_n: int = 4, spec_factor: float | None = None) -> tuple[int, int, int, int]:
    """(verify steps, drafts proposed, drafts accepted, decode steps) that greedy ngram decoding must show,
    replayed from the plain greedy ``output`` (longer than max_tokens by k + 1): the prefill
    emits output[0]; then each step drafts from the tokens so far and accepts the prefix
    that equals the greedy continuation."""
    steps = proposed = accepted = decode_steps = 0
    j = 1
    while j < max_tokens:
        decode_steps += 1
        drafts = find_ngram_drafts(prompt + output[:j], min_n, max_n, k, spec_factor)
        n = 0
        while n < len(drafts) and drafts[n] == output[j + n]:
            n += 1
        if drafts:
            steps, proposed, accepted = steps + 1, proposed + len(drafts), accepted + n
        j += n + 1
    return steps, proposed, accepted, decode_steps


@pytest.fixture(scope="module")
def plain_runs():
    """Plain greedy outputs (8 tokens past MAX_TOKENS, for the replay) per model, plus the
    fed-back prompt: a base prompt followed by the first 24 tokens of its own continuation."""
    out = {}
    long = SamplingParams(max_tokens=MAX_TOKENS + 8, ignore_eos=True)
    for model in ("tiny-llama", "tiny-moe"):
        with LLM(config(model, spec=False)) as llm:
            base = [o.token_ids for o in llm.generate(BASE_PROMPTS, long)]
            prompts = BASE_PROMPTS + [BASE_PROMPTS[1] + base[1][:24]]
            out[model] = prompts, base + [llm.generate([prompts[-1]], long)[0].token_ids]
    return out


def check_run(llm: LLM, plain_run, k: int, **rule) -> list:
    prompts, plain = plain_run
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [p[:MAX_TOKENS] for p in plain]
    for prompt, o, p in zip(prompts, outs, plain):
        m = o.metrics
        got = (m["num_verify_steps"], m["num_draft_tokens"], m["num_accepted_tokens"], m["num_decode_steps"])
        assert got == expected_drafting(prompt, p, MAX_TOKENS, k, **rule)
    assert llm.geometry.keys() == {"target"}
    return outs


@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_ngram_output_is_the_plain_output(plain_runs, k, page):
    with LLM(config(k=k, page=page)) as llm:
        outs = check_run(llm, plain_runs["tiny-llama"], k)
        allocator = llm._engine.allocator
        assert allocator.num_free == allocator.num_blocks
    # the loops repeat: drafts were proposed and accepted (AL > 1), fewer than k where a match ran short
    steps = sum(o.metrics["num_verify_steps"] for o in outs)
    assert all(o.metrics["acceptance_length"] > 1.0 for o in outs)
    if k > 1:
        assert sum(o.metrics["num_draft_tokens"] for o in outs) < steps * k


def test_a_spec_factor_drafts_what_the_rule_says_and_stays_lossless(plain_runs):
    """k = 7 capped at 1.5 drafts per matched token (4-gram matches: up to 6): the engine's drafts
    and acceptances are the replay's, and the output is plain greedy's."""
    prompts, plain = plain_runs["tiny-llama"]
    # the cap binds on these prompts: an engine that ignored the factor would draft otherwise
    assert any(expected_drafting(q, p, MAX_TOKENS, 7, 1, 4, 1.5) != expected_drafting(q, p, MAX_TOKENS, 7, 1, 4)
               for q, p in zip(prompts, plain))
    lookup = dict(prompt_lookup_min=1, prompt_lookup_max=4, prompt_lookup_spec_factor=1.5)
    with LLM(config(k=7, page=32, **lookup)) as llm:
        check_run(llm, plain_runs["tiny-llama"], 7, min_n=1, max_n=4, spec_factor=1.5)
        allocator = llm._engine.allocator
        assert allocator.num_free == allocator.num_blocks


def test_no_page_leaks_after_rollbacks_and_preemptions(plain_runs):
    with LLM(config(k=7, capacity=256)) as llm:  # 8 pages of 32 tokens cannot hold every request
        prompts, plain = plain_runs["tiny-llama"]
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        allocator = llm._engine.allocator
        assert allocator.num_free == allocator.num_blocks
    assert [o.token_ids for o in outs] == [p[:MAX_TOKENS] for p in plain]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_a_sequence_without_a_repeated_ngram_proposes_nothing(plain_runs):
    """Distinct prompt tokens and n = 8 > the steps it decodes: no 8-gram can repeat (an earlier
    occurrence would start inside the prompt at another position of the suffix's first
    token). It shares its batch with a looping sequence, which drafts: rows of 0 and of
    several drafts verify in the same steps."""
    distinct, looping = list(range(3, 43)), BASE_PROMPTS[0]
    params = [SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)]
    with LLM(config(k=3, prompt_lookup_min=8, prompt_lookup_max=8)) as llm:
        quiet, busy = llm.generate([distinct, looping], params)
        allocator = llm._engine.allocator
        assert allocator.num_free == allocator.num_blocks
    with LLM(config(spec=False)) as llm:
        assert quiet.token_ids == llm.generate([distinct], params[0])[0].token_ids
    assert all(find_ngram_drafts(distinct + quiet.token_ids[:j], 8, 8, 3) == [] for j in range(1, 8))
    m = quiet.metrics
    assert (m["num_verify_steps"], m["num_draft_tokens"], m["acceptance_length"]) == (0, 0, 1.0)
    assert (m["num_decode_steps"], m["tokens_per_decode_step"]) == (7, 1.0)
    assert busy.token_ids == plain_runs["tiny-llama"][1][0][:MAX_TOKENS]
    assert busy.metrics["num_draft_tokens"] > 0


def test_seeded_sampled_ngram_is_reproducible():
    # The random presets' logits are nearly flat: at temperature 0.05 the samples still differ
    # from greedy, yet repeat enough for drafts to be proposed, accepted and rejected.
    params = SamplingParams(max_tokens=32, temperature=0.05, seed=7, ignore_eos=True)
    with LLM(config(k=3)) as llm:
        a = llm.generate(BASE_PROMPTS, params)
        b = llm.generate(BASE_PROMPTS, params)
        greedy = llm.generate(BASE_PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]
    proposed = sum(o.metrics["num_draft_tokens"] for o in a)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in a)
    assert proposed > accepted > 0  # rejection sampling both accepted and rejected n-gram drafts


@pytest.mark.parametrize("model, k, page, moe_ep", [("tiny-llama", 7, 32, None), ("tiny-moe", 3, 64, 2)])
def test_two_ranks_verify_the_same_drafts(plain_runs, model, k, page, moe_ep):
    """Under ``mp`` every rank drafts from its own mirrored tokens; ``check_every_step``
    compares the ranks' tokens after every step (their drafts differing would break the
    sharded forward or the accepted counts)."""
    pytest.importorskip("specray.launch.mp", reason="the mp launcher is not in this build")
    parallel = ParallelConfig(tp_size=2, moe_ep_size=moe_ep, launcher="mp", check_every_step=True, timeout_s=60.0)
    with LLM(config(model, k=k, page=page, parallel=parallel)) as llm:
        check_run(llm, plain_runs[model], k)
