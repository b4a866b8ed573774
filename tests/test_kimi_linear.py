"""Kimi Linear (hybrid: KDA layers and MLA layers without RoPE, DeepSeek-routed MoE) against
transformers' KimiLinearForCausalLM on a tiny save_pretrained checkpoint (float32 CPU, its torch
fallbacks): the KDA rules, greedy tokens at TP 1 and 2, the state slots after prefill, mutation
checks on the state, ngram speculation (verify with state commit) and the preset."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, reference_greedy
from hybrid import assert_no_slot_held, hybrid_config as config
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.models import kimi_linear
from specray.models.linear_state import LayerState

# around 16- and 32-token pages (15, 16, 17, 33), past one chunk of the chunked rule (64) and, with
# the 48-token step budget below, prefilled in several steps (100, 130)
PROMPT_LENS = (15, 16, 17, 33, 100, 130)
NEW_TOKENS = 72
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
KDA_LAYERS = (0, 1, 3)
# conv window [3 x 4 x 16, 3] and recurrent state [4, 16, 16] per KDA layer, three KDA layers, float32
SLOT_BYTES = 3 * (192 * 3 + 4 * 16 * 16) * 4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    directory = make_checkpoint("kimi_linear", tmp_path_factory.mktemp("kimi_linear"))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    reference = load_reference(directory)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    return directory, prompts, expected, reference



def test_checkpoint_has_the_shapes_under_test(case):
    from specray.models.loader import read_model_arch

    arch = read_model_arch(case[0])
    assert arch.mixers == ("kda", "kda", "mla", "kda")
    assert arch.kv_layers == (2,) and arch.linear_layers == KDA_LAYERS
    assert arch.moe_layers == (1, 2, 3) and arch.router.num_shared_experts == 1  # layer 0 dense
    assert not arch.mla.has_rope and arch.mla.latent_dim == 32 + 8
    assert (arch.linear.num_k_heads, arch.linear.k_head_dim, arch.linear.conv_dim) == (4, 16, 192)
    assert arch.kv_bytes_per_token(4, 1) == 1 * 40 * 4  # one MLA layer's latent row


def test_rope_scaling_changes_nothing_as_in_transformers(case):
    # KimiLinearAttention has no rotary embedding and scales by qk_head_dim^-0.5: a YaRN entry in the
    # config (which would scale DeepSeek-V3's softmax) is ignored, as transformers ignores it
    from specray.models.arch import arch_from_hf_config

    cfg = json.loads((case[0] / "config.json").read_text())
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                original_max_position_embeddings=256)
    assert arch_from_hf_config(dict(cfg, rope_parameters=yarn)) == arch_from_hf_config(cfg)


def test_config_errors_name_the_value_and_the_rule(case):
    from specray.launch.mapping import validate_mapping
    from specray.models.arch import arch_from_hf_config

    cfg = json.loads((case[0] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention', 'sliding'\] must name one of"):
        arch_from_hf_config(dict(cfg, num_hidden_layers=2, layer_types=["linear_attention", "sliding"]))
    lin = dict(cfg["linear_attn_config"], kda_layers=[1, 2, 5])
    with pytest.raises(ValueError, match=r"kda_layers names layer 5; layers are numbered 1 to 4"):
        arch_from_hf_config(dict(cfg, layer_types=None, linear_attn_config=lin))
    with pytest.raises(ValueError, match=r"mlp_layer_types \['dense', 'moe'\] must name one of"):
        arch_from_hf_config(dict(cfg, mlp_layer_types=["dense", "moe"]))
    odd = dict(cfg, linear_attn_config=dict(cfg["linear_attn_config"], num_heads=3))
    with pytest.raises(ValueError, match=r"tp_size \(2\) must divide the linear-attention key heads \(3\)"):
        validate_mapping(arch_from_hf_config(odd), ParallelConfig(tp_size=2))


def test_layer_types_from_linear_attn_config_as_transformers_reads_them(case):
    import transformers

    from specray.models.arch import arch_from_hf_config

    cfg = json.loads((case[0] / "config.json").read_text())
    for lists in (dict(kda_layers=[1, 3], full_attn_layers=[2, 4]), {}):  # explicit, and the default
        raw = dict(cfg, layer_types=None, linear_attn_config=dict(cfg["linear_attn_config"], **lists))
        if not lists:
            raw["linear_attn_config"] = {k: v for k, v in raw["linear_attn_config"].items() if "layers" not in k}
        hf = transformers.KimiLinearConfig(**{k: v for k, v in raw.items() if k != "layer_types"}).layer_types
        mixers = arch_from_hf_config(raw).mixers
        assert mixers == tuple("kda" if t == "linear_attention" else "mla" for t in hf)


def test_chunked_and_recurrent_rules_match_transformers():
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    from specray.models.kda import chunk_kda, recurrent_kda

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 150, 3, 8, generator=gen), torch.randn(2, 150, 3, 8, generator=gen)
    v, beta = torch.randn(2, 150, 3, 6, generator=gen), torch.rand(2, 150, 3, generator=gen)
    g, s0 = -torch.rand(2, 150, 3, 8, generator=gen) * 0.5, torch.randn(2, 3, 8, 6, generator=gen)
    ref_out, ref_state = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, s0, True, use_qk_l2norm_in_kernel=True)
    out, every = recurrent_kda(q, k, v, g, beta, initial_state=s0, return_all_states=True)
    assert torch.equal(out, ref_out) and torch.equal(every[:, -1], ref_state)  # the same loop, bit for bit
    _, after_ten = recurrent_kda(q[:, :10], k[:, :10], v[:, :10], g[:, :10], beta[:, :10], initial_state=s0)
    assert torch.equal(every[:, 9], after_ten)
    # the chunked rule (chunks of 64, the last one short): float32 rounding of other sums, ~1e-7
    # on outputs of order 1, where a wrong decay or a dropped chunk is order 1e-1
    chunk_out, chunk_state = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    torch.testing.assert_close(chunk_out, ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunk_state, ref_state, rtol=0, atol=1e-5)


def test_bfloat16_keeps_the_state_and_the_decay_bias_in_float32(case):
    directory, prompts, _, _ = case
    with LLM(config(directory, dtype="bfloat16", max_num_batched_tokens=48)) as llm:
        out = llm.generate(prompts[4:5], SamplingParams(max_tokens=16, ignore_eos=True))[0]
        worker = llm._engine.worker
        state, kda = worker.pools[0], worker.model.layers[0].self_attn
        geometry = llm.geometry
    assert len(out.token_ids) == 16
    assert state.conv.dtype == state.recurrent.dtype == torch.float32 and state.recurrent.abs().sum() > 0
    assert kda.dt_bias.dtype == torch.float32 and kda.qkv.weight.dtype == torch.bfloat16
    assert geometry["target"].dtype == "bfloat16" and geometry["state"].dtype == "float32"


@pytest.mark.parametrize("tokens_per_block,budget", [(16, 48), (32, None)])
def test_greedy_matches_transformers(case, tokens_per_block, budget):
    directory, prompts, expected, _ = case
    kv = KVConfig(tokens_per_block=tokens_per_block, capacity_tokens=2048)
    with LLM(config(directory, kv=kv, max_num_batched_tokens=budget)) as llm:
        outs = llm.generate(prompts, GREEDY)  # one batch of every prompt
        geometry = llm.geometry
    assert [o.token_ids for o in outs] == expected
    # only the MLA layer has pages (latent rows); the three KDA layers have a slot per sequence
    assert geometry["target"].num_layers == 1 and geometry["target"].kind == "latent"
    assert geometry["state"].num_slots == 8 and geometry["state"].num_bytes == 8 * SLOT_BYTES


def test_states_after_prefill_match_transformers_cache(case):
    # max_tokens=1: the step that ends the prompt samples the one token and never feeds it, so the
    # slot's rows hold the state after exactly the prompt (prefilled in three chunks of <= 48).
    # Tolerance: float32 both sides; the conv window is the last 3 inputs, copied, so it is exact
    # up to the projections' rounding; the chunked rule's chunks start at other positions than
    # transformers' (each prefill step restarts them), so the states differ by rounding only,
    # ~1e-7 on entries of order 0.1-1, where a lost chunk or a wrong head is order 1e-1.
    directory, prompts, _, reference = case
    prompt = prompts[-1]
    with LLM(config(directory, max_num_batched_tokens=48)) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1))
        worker = llm._engine.worker
        states = [worker.pools[i] for i in worker.arch.linear_layers]
    with torch.inference_mode():
        cache = reference(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          use_cache=True).past_key_values
    for layer, state in zip(KDA_LAYERS, states):
        assert isinstance(state, LayerState)
        # transformers keeps kernel_size inputs of [q | k | v], the first of which no later step reads
        torch.testing.assert_close(state.conv[0], cache.get_conv_state(layer)[0, :, 1:], rtol=0, atol=1e-5)
        torch.testing.assert_close(state.recurrent[0], cache.get_recurrent_state(layer)[0], rtol=0, atol=1e-5)
        assert state.recurrent[0].abs().max() > 0.05  # a state the comparison can tell from zeros


def _mutated_tokens(directory, prompts, patch, name, wrapper):
    real = getattr(kimi_linear, name)
    patch.setattr(kimi_linear, name, lambda *a, **kw: real(*a, **wrapper(kw)))
    with LLM(config(directory, max_num_batched_tokens=48)) as llm:
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]


def test_decode_and_chunked_prefill_read_the_state(case, monkeypatch):
    # mutation checks: decode steps that ignored the committed state or the conv window, or prefill
    # chunks that restarted from zeros, would still produce tokens; the tests above must see them change
    directory, prompts, expected, _ = case
    with monkeypatch.context() as patch:
        forgetful = _mutated_tokens(directory, prompts[:1], patch, "recurrent_kda",
                                    lambda kw: dict(kw, initial_state=None))
    assert forgetful[0] != expected[0][:24]
    with monkeypatch.context() as patch:
        # 100 tokens in chunks of 48, 48 and 4: the last would start with no memory of the prompt
        restarted = _mutated_tokens(directory, prompts[4:5], patch, "chunk_kda", lambda kw: dict(kw, initial_state=None))
    assert restarted[0] != expected[4][:24]
    real_conv = kimi_linear.short_conv

    def blind_conv(mixed, windows, weight, plan):  # every step's conv window read as zeros
        windows.zero_()
        return real_conv(mixed, windows, weight, plan)

    with monkeypatch.context() as patch:
        patch.setattr(kimi_linear, "short_conv", blind_conv)
        with LLM(config(directory, max_num_batched_tokens=48)) as llm:
            blind = llm.generate(prompts[:1], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    assert blind != expected[0][:24]


def test_ngram_speculation_matches_plain_greedy(case, monkeypatch):
    # verify rows go through the recurrent rule keeping the state after every position, and the
    # accepted one is committed (linear_state.py): the tokens must equal plain greedy decoding.
    # Prompt lookup from 1-grams up proposes drafts at most steps; a random model rejects them
    # (acceptance at n >= 1 is the scripted drafter's test), so every verify commits scratch row 1.
    directory, prompts, expected, _ = case
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    spec = SpecConfig(method="ngram", num_draft_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    with LLM(config(directory, spec=spec, max_num_batched_tokens=48)) as llm:
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["acceptance_histogram"][0] for o in outs) > 0  # rejected drafts: the commit had work
    # mutation: without the commit a rejected draft's state survives, and the tokens must change
    from specray.workers import worker

    monkeypatch.setattr(worker, "commit_accepted", lambda *a, **kw: None)
    with LLM(config(directory, spec=spec, max_num_batched_tokens=48)) as llm:
        uncommitted = [o.token_ids for o in llm.generate(prompts[:2], params)]
    assert uncommitted != expected[:2]


def test_ngram_speculation_at_tp2_matches_plain_greedy(case):
    # the same verify and commit on every rank, each over its own KDA heads' state rows
    directory, prompts, expected, _ = case
    spec = SpecConfig(method="ngram", num_draft_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    with LLM(config(directory, tp=2, spec=spec, max_num_batched_tokens=48)) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_verify_steps"] for o in outs) > 0


def _scripted_propose(references: list[list[int]], k: int):
    """A drafter's ``propose`` that drafts each sequence's reference continuation with one planted
    error at position j (j = k: none), j cycling over steps and sequences, so every acceptance
    count 0..k occurs inside the batches."""
    calls = []

    def propose(self, batch, choose):
        calls.append(None)
        drafts = []
        for i, seq in enumerate(batch.seqs):
            # a sequence off every reference (a wrong token was kept) gets no drafts: its output shows it
            ref = next((r for r in references if r[:len(seq.tokens)] == list(seq.tokens)), [])
            d = list(ref[len(seq.tokens):len(seq.tokens) + batch.k])
            j = (len(calls) + i) % (k + 1)
            if j < len(d):
                d[j] = (d[j] + 1) % 384
            drafts.append(d)
        return drafts

    return propose


def test_verify_commits_every_acceptance_count(case, monkeypatch):
    # KDA's verify rows through linear_state.py: n of the k drafts accepted for every n in 0..k in
    # the same batches; the committed state must be the one after exactly the accepted tokens
    from specray.models.drafters import ngram
    from specray.workers import worker

    directory, prompts, expected, _ = case
    k = 3
    monkeypatch.setattr(ngram.NgramDrafter, "propose",
                        _scripted_propose([p + e for p, e in zip(prompts, expected)], k))
    spec = SpecConfig(method="ngram", num_draft_tokens=k)
    with LLM(config(directory, spec=spec, max_num_batched_tokens=48)) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    histogram = [sum(o.metrics["acceptance_histogram"][n] for o in outs) for n in range(k + 1)]
    assert all(count > 0 for count in histogram), histogram
    monkeypatch.setattr(worker, "commit_accepted", lambda *a, **kw: None)  # mutation: no commit
    with LLM(config(directory, spec=spec, max_num_batched_tokens=48)) as llm:
        uncommitted = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert uncommitted != expected


@pytest.mark.parametrize("moe_tp,moe_ep", [(2, 1), (1, 2)])
def test_tp2_matches_transformers(case, moe_tp, moe_ep):
    directory, prompts, expected, _ = case
    cfg = config(directory, tp=2, max_num_batched_tokens=48)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, moe_tp_size=moe_tp, moe_ep_size=moe_ep))
    with LLM(cfg) as llm:
        outs = llm.generate(prompts, GREEDY)
        state = llm.geometry["state"]
    assert [o.token_ids for o in outs] == expected
    # each rank holds two of the four KDA heads: half the conv channels and of the recurrent state
    assert (state.layout.conv_dim, state.layout.num_heads) == (96, 2)


def test_preset_matches_transformers():
    # the preset is written in Moonshot's own layout and config spellings (kimi_checkpoint.py), which
    # transformers reads through its conversion mapping: both readers must agree on it
    from specray.models.presets import materialize

    reference = load_reference(materialize("tiny-kimi-linear"))
    prompt = [256] + list(b"Hybrid models keep a state per sequence")
    with LLM(EngineConfig(model="tiny-kimi-linear", kv=KVConfig(capacity_tokens=1024), max_num_seqs=2)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == reference_greedy(reference, prompt, 64)


@pytest.mark.parametrize("method", ["draft_model", "dflash", "dspark"])
def test_the_preset_drafters_keep_the_greedy_tokens(method):
    # the preset's drafters (random heads; for draft_model the target's MLA layer cut out, its own
    # latent pool) rarely match, so this holds the plumbing; the commit is held by the scripted test
    from specray.models.presets import materialize

    reference = load_reference(materialize("tiny-kimi-linear"))
    prompt = [256] + list(b"Hybrid models keep a state per sequence")
    spec = SpecConfig(method=method, num_draft_tokens=3)
    with LLM(EngineConfig(model="tiny-kimi-linear", kv=KVConfig(capacity_tokens=1024), max_num_seqs=2,
                          spec=spec)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        assert_no_slot_held(llm)
        if method == "draft_model":
            draft = llm.geometry["draft"]
            assert (draft.kind, draft.num_layers) == ("latent", 1)
    assert out.token_ids == reference_greedy(reference, prompt, 32)
    assert out.metrics["num_verify_steps"] > 0
