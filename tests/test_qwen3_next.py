"""Qwen3-Next (hybrid: Gated DeltaNet and gated attention layers) against transformers'
Qwen3NextForCausalLM on a tiny save_pretrained checkpoint (float32 CPU, its torch fallbacks):
greedy tokens, the state slots after prefill, the slots' life cycle (admission, finish, abort,
preemption), the budget, and a sharded run under mp."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, reference_greedy
from hybrid import assert_no_slot_held, hybrid_config as config
from specray import LLM, AsyncLLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.models import qwen3_next
from specray.models.linear_state import LayerState

# around 16- and 32-token pages (15, 16, 17, 33), past one chunk of the chunked rule (64) and, with
# the 48-token step budget below, prefilled in several steps (100, 130)
PROMPT_LENS = (15, 16, 17, 33, 100, 130)
NEW_TOKENS = 72
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
# conv window [96, 3] and recurrent state [4, 16, 8] per linear layer, two linear layers, float32
SLOT_BYTES = 2 * (96 * 3 + 4 * 16 * 8) * 4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    directory = make_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next"))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    reference = load_reference(directory)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    return directory, prompts, expected, reference




def test_checkpoint_has_the_shapes_under_test(case):
    from specray.models.loader import read_model_arch

    arch = read_model_arch(case[0])
    assert arch.mixers == ("linear_attention", "gated_attention") * 2
    assert arch.kv_layers == (1, 3) and arch.linear_layers == (0, 2)
    assert arch.moe_layers == (1, 2, 3) and arch.shared_expert_intermediate_size == 48  # layer 0 dense
    assert arch.rotary_dim == 4 and arch.head_dim == 16 and arch.is_zero_centred_norm  # partial RoPE: 16 / 4
    assert (arch.linear.num_k_heads, arch.linear.num_v_heads, arch.linear.conv_dim) == (2, 4, 96)


def test_config_errors_name_the_value_and_the_rule(case):
    from specray.launch.mapping import validate_mapping
    from specray.models.arch import arch_from_hf_config

    cfg = json.loads((case[0] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention', 'sliding'\] must name one of"):
        arch_from_hf_config(dict(cfg, num_hidden_layers=2, layer_types=["linear_attention", "sliding"]))
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads"):
        arch_from_hf_config(dict(cfg, linear_num_value_heads=3))
    with pytest.raises(ValueError, match=r"tp_size \(4\) must divide the linear-attention key heads \(2\)"):
        validate_mapping(arch_from_hf_config(cfg), ParallelConfig(tp_size=4))


def test_partial_rotary_factor_is_read_where_transformers_reads_it(case):
    import transformers

    from specray.models.arch import arch_from_hf_config

    cfg = json.loads((case[0] / "config.json").read_text())
    cfg.pop("rope_parameters")
    # Qwen3-Next-80B's own config.json: the factor at the top level beside rope_scaling null; and none at all
    for extra in (dict(partial_rotary_factor=0.5, rope_scaling=None), {}):
        hf = transformers.Qwen3NextConfig(**dict(cfg, **extra)).rope_parameters["partial_rotary_factor"]
        assert arch_from_hf_config(dict(cfg, **extra)).rotary_dim == int(16 * hf)  # 8, then transformers' 0.25: 4


def test_bfloat16_keeps_the_state_in_float32(case):
    directory, prompts, _, _ = case
    with LLM(config(directory, dtype="bfloat16", max_num_batched_tokens=48)) as llm:
        out = llm.generate(prompts[4:5], SamplingParams(max_tokens=16, ignore_eos=True))[0]
        state = llm._engine.worker.pools[0]
        geometry = llm.geometry
    assert len(out.token_ids) == 16
    assert state.conv.dtype == state.recurrent.dtype == torch.float32 and state.recurrent.abs().sum() > 0
    assert geometry["target"].dtype == "bfloat16" and geometry["state"].dtype == "float32"


@pytest.mark.parametrize("tokens_per_block,budget", [(16, 48), (32, None)])
def test_greedy_matches_transformers(case, tokens_per_block, budget):
    directory, prompts, expected, _ = case
    kv = KVConfig(tokens_per_block=tokens_per_block, capacity_tokens=2048)
    with LLM(config(directory, kv=kv, max_num_batched_tokens=budget)) as llm:
        outs = llm.generate(prompts, GREEDY)  # one batch of every prompt
        geometry = llm.geometry
        assert_no_slot_held(llm)
    assert [o.token_ids for o in outs] == expected
    # only the two full-attention layers have pages; the two linear layers have a slot per sequence
    assert geometry["target"].num_layers == 2 and geometry["state"].num_slots == 8
    assert geometry["state"].num_bytes == 8 * SLOT_BYTES


def test_states_after_prefill_match_transformers_cache(case):
    # max_tokens=1: the step that ends the prompt samples the one token and never feeds it, so the
    # slot's rows hold the state after exactly the prompt (prefilled in three chunks of <= 48).
    # Tolerance: float32 both sides; the chunked rule's chunks start at other positions than
    # transformers' (each prefill step restarts them), so the sums differ by rounding only: ~1e-7
    # on conv inputs and states of order 0.1-1, where a lost chunk or a wrong head is order 1e-1.
    directory, prompts, _, reference = case
    prompt = prompts[-1]
    with LLM(config(directory, max_num_batched_tokens=48)) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1))
        worker = llm._engine.worker
        states = [worker.pools[i] for i in worker.arch.linear_layers]
    with torch.inference_mode():
        cache = reference(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          use_cache=True).past_key_values
    for layer, state in zip((0, 2), states):
        assert isinstance(state, LayerState)
        # transformers keeps kernel_size inputs, the first of which no later step reads
        torch.testing.assert_close(state.conv[0], cache.get_conv_state(layer)[0, :, 1:], rtol=0, atol=1e-5)
        torch.testing.assert_close(state.recurrent[0], cache.get_recurrent_state(layer)[0], rtol=0, atol=1e-5)


def _mutated_tokens(directory, prompts, patch, name, wrapper):
    real = getattr(qwen3_next, name)
    patch.setattr(qwen3_next, name, lambda *a, **kw: real(*a, **wrapper(kw)))
    with LLM(config(directory, max_num_batched_tokens=48)) as llm:
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]


def test_decode_and_chunked_prefill_read_the_state(case, monkeypatch):
    # mutation checks: decode steps that ignored the committed state or the conv window, or prefill
    # chunks that restarted from zeros, would still produce tokens; the tests above must see them change
    directory, prompts, expected, _ = case
    with monkeypatch.context() as patch:
        forgetful = _mutated_tokens(directory, prompts[:1], patch, "recurrent_gated_delta_rule",
                                    lambda kw: dict(kw, initial_state=None))
    assert forgetful[0] != expected[0][:24]
    with monkeypatch.context() as patch:
        # 100 tokens in chunks of 48, 48 and 4: the last would start with no memory of the prompt
        restarted = _mutated_tokens(directory, prompts[4:5], patch, "chunk_gated_delta_rule",
                                    lambda kw: dict(kw, initial_state=None))
    assert restarted[0] != expected[4][:24]
    real_conv = qwen3_next.GatedDeltaNet._conv

    def blind_conv(self, mixed, windows, plan):  # every step's conv window read as zeros
        windows.zero_()
        return real_conv(self, mixed, windows, plan)

    with monkeypatch.context() as patch:
        patch.setattr(qwen3_next.GatedDeltaNet, "_conv", blind_conv)
        with LLM(config(directory, max_num_batched_tokens=48)) as llm:
            blind = llm.generate(prompts[:1], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    assert blind != expected[0][:24]


def test_preemption_under_a_tiny_budget_keeps_the_tokens_and_frees_every_slot(case):
    # 14 pages of 16 tokens cannot hold three of these sequences at once: the latest is preempted,
    # gives its slot back, and recomputes from position 0 (a fresh state) when it is readmitted
    directory, prompts, expected, _ = case
    with LLM(config(directory, kv=KVConfig(tokens_per_block=16, capacity_tokens=224), max_num_seqs=3)) as llm:
        outs = llm.generate(prompts[2:5], GREEDY)
        assert_no_slot_held(llm)
    assert [o.token_ids for o in outs] == expected[2:5]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_no_slot_leaks_once_idle_aborts_included(case):
    directory, prompts, expected, _ = case

    async def main():
        llm = AsyncLLM(config(directory, max_num_seqs=2))
        try:
            victim = llm.generate(prompts[0], GREEDY, "victim")
            await victim.__anext__()  # admitted and decoding: it holds a slot
            waiting = [llm.generate(p, GREEDY, f"w{i}") for i, p in enumerate(prompts[1:4])]
            await llm.abort("victim")
            await llm.abort("w2")  # aborted while it may still wait for a slot
            outs = await asyncio.gather(*(_tokens(s) for s in waiting))
            assert outs[0] == expected[1] and outs[1] == expected[2]
            assert_no_slot_held(llm)
        finally:
            await llm.close()

    asyncio.run(asyncio.wait_for(main(), 180))


async def _tokens(stream) -> list[int]:
    out = []
    async for delta in stream:
        out += delta.new_token_ids
    return out


def test_scheduler_takes_a_slot_on_admission_and_frees_it_on_every_exit():
    from specray.executor.scheduler import Scheduler, Sequence
    from specray.kv.allocator import BlockAllocator
    from specray.kv.state_slots import StateSlotAllocator

    slots = StateSlotAllocator(2, 1)
    sched = Scheduler(BlockAllocator(64), 16, max_num_seqs=4, max_num_batched_tokens=512, state_allocator=slots)
    seqs = [Sequence(i, [1, 2, 3], 3, SamplingParams(max_tokens=2, ignore_eos=True), seed=i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()  # two slots: the third waits although max_num_seqs and pages allow it
    assert plan.seq_ids == [0, 1] and plan.state_rows == {0: 0, 1: 1} and slots.num_free == 0
    sched.finish_step([7, 7])
    assert sched.schedule().state_rows == {}  # known rows are not sent again
    sched.abort(seqs[0])  # abort of a running sequence frees its slot...
    plan = sched.schedule()
    assert plan.state_rows == {2: 0}  # ...which the waiting one takes
    sched.finish_step([8, 9])  # sequence 1 finishes (max_tokens 2)
    assert slots.num_free == 1
    sched._preempt_latest()  # preemption too; readmission takes a slot again
    assert slots.num_free == 2
    assert sched.schedule().state_rows == {2: 0}


def test_budget_too_small_for_the_slots_is_a_clear_error(case):
    directory = case[0]
    with pytest.raises(ValueError, match=rf"cannot hold the state slots: 64 slots x {SLOT_BYTES} bytes = "
                                         rf"{64 * SLOT_BYTES} bytes needed"):
        LLM(config(directory, kv=KVConfig(cpu_max_bytes=100_000), max_num_seqs=64))


def test_ngram_speculation_keeps_the_greedy_tokens(case):
    # repeated prompts give the n-gram drafter something to find, so verify rows (and their state
    # commits, tests/test_hybrid_rollback.py) occur beside plain decode rows and prefill chunks
    directory, prompts, expected, reference = case
    repeated = [p[:6] * 4 for p in prompts[:3]]
    spec = SpecConfig(method="ngram", num_draft_tokens=3)
    with LLM(config(directory, spec=spec, max_num_batched_tokens=48)) as llm:
        outs = llm.generate(prompts[:3] + repeated, GREEDY)
        assert_no_slot_held(llm)
    assert [o.token_ids for o in outs[:3]] == expected[:3]
    assert [o.token_ids for o in outs[3:]] == [reference_greedy(reference, p, NEW_TOKENS) for p in repeated]


def test_speculation_under_preemption_keeps_the_tokens_and_frees_every_slot(case):
    # verify rows reserve pages for k drafts, so 14 pages preempt sooner than plain decoding does;
    # a preempted sequence recomputes its state from zero and drafts again once it decodes
    directory, prompts, _, reference = case
    repeated = [p[:6] * 3 for p in prompts[2:5]]
    spec = SpecConfig(method="ngram", num_draft_tokens=3)
    with LLM(config(directory, spec=spec, kv=KVConfig(tokens_per_block=16, capacity_tokens=224), max_num_seqs=3)) as llm:
        outs = llm.generate(repeated, GREEDY)
        assert_no_slot_held(llm)
        sampled = llm.generate(repeated, SamplingParams(max_tokens=24, temperature=0.8, seed=3))
        assert_no_slot_held(llm)
    assert [o.token_ids for o in outs] == [reference_greedy(reference, p, NEW_TOKENS) for p in repeated]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert all(len(o.token_ids) == 24 for o in sampled)


@pytest.mark.parametrize("method", ["draft_model", "dflash", "dspark", "eagle3"])
def test_every_drafter_on_the_hybrid_preset_keeps_the_greedy_tokens(method):
    # the preset's drafters (random heads, and for draft_model the target's full-attention layer
    # cut out) rarely match, so this holds the plumbing; test_hybrid_rollback.py holds the commit
    from specray.models.presets import materialize

    reference = load_reference(materialize("tiny-qwen3-next"))
    prompts = [[256] + list(b"Hybrid models keep a state per sequence"), [256] + list(b"def f(x):")]
    spec = SpecConfig(method=method, num_draft_tokens=3)
    with LLM(EngineConfig(model="tiny-qwen3-next", kv=KVConfig(capacity_tokens=1024), max_num_seqs=2, spec=spec)) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        assert_no_slot_held(llm)
    assert [o.token_ids for o in outs] == [reference_greedy(reference, p, 32) for p in prompts]


def test_a_hybrid_draft_model_is_refused_with_the_reason(case, tmp_path):
    with pytest.raises(ValueError, match=r"has linear-attention layers \[0, 2\]: a draft model keeps its KV "
                                         r"in a paged pool and has no state slots"):
        LLM(config(case[0], spec=SpecConfig(method="draft_model", draft_model=str(case[0]), num_draft_tokens=2)))


def test_preset_matches_transformers():
    from specray.models.presets import materialize

    reference = load_reference(materialize("tiny-qwen3-next"))
    prompt = [256] + list(b"Hybrid models keep a state per sequence")
    with LLM(EngineConfig(model="tiny-qwen3-next", kv=KVConfig(capacity_tokens=1024), max_num_seqs=2)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == reference_greedy(reference, prompt, 64)


@pytest.mark.parametrize("moe_tp,moe_ep", [(2, 1), (1, 2)])
def test_tp2_matches_transformers(case, moe_tp, moe_ep):
    directory, prompts, expected, _ = case
    cfg = config(directory, tp=2, max_num_batched_tokens=48)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, moe_tp_size=moe_tp, moe_ep_size=moe_ep))
    with LLM(cfg) as llm:
        outs = llm.generate(prompts, GREEDY)
        state = llm.geometry["state"]
    assert [o.token_ids for o in outs] == expected
    # each rank holds one key-head group: half the conv channels and value heads
    assert (state.layout.conv_dim, state.layout.num_heads) == (48, 2)


def test_a_state_pool_mismatch_between_ranks_stops_start_up_naming_rank_pool_and_field(case, monkeypatch):
    # the state pool goes through the same fingerprint check as the pages: rank 1 allocating two
    # rows too many (a fault injected after the agreement) must stop start-up on every rank
    monkeypatch.setenv("SPECRAY_FAULT_STATE_EXTRA_SLOTS", "1:2")
    with pytest.raises(Exception, match=r"KV geometry mismatch: rank 1 allocated state.num_slots = 10, "
                                        r"rank 0 allocated 8"):
        LLM(config(case[0], tp=2))
