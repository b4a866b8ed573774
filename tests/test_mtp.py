"""MTP from the target checkpoint itself (DeepSeek-V3 and Qwen3-Next layouts): drafts against
``speculators``' MTP layer, losslessness in the engine (tiny presets, TP 1 and 2, a MoE
target with expert parallelism, k in {1, 3, 7}, 32- and 64-token pages), the preset, and
bad input.

Reference: ``speculators``' MTP layer (``speculators.models.mtp.model_definitions``: its
``MTPLayerMixin`` over transformers' decoder layer, loaded without speculators' training
stack as test_drafter_formats.py does) computes
``final_layernorm(block(input_proj([token_layernorm(emb); hidden_layernorm(h)])))``, the same
module as DeepSeek-V3's and Qwen3-Next's under other names. The test maps the checkpoint's
tensors onto it (Qwen3-Next's zero-centred norms ``x * (1 + w)`` become ``1 + w``) and writes
out what lies outside the layer, as the published equations: logits through DeepSeek-V3's
``shared_head`` (the layer's final norm is shared_head.norm, and the pre-norm output is fed
back) or the target's LM head (Qwen3-Next: the normed output is fed back), the target's
final hidden states as the first h, and the module schedule (draft j uses module
min(j, n - 1); every module catches up on the prompt from the target's hidden states).
speculators' own model class is a teacher-forced training forward (one module), so only the
layer is used. Llama blocks use the same mixin over transformers' Llama layer.

Tolerance: as test_drafter_formats.py (same float32 maths, another operation order).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import load_reference, make_checkpoint
from drafter_checkpoints import empty_pools, propose, speculators_module
from safetensors.torch import load_file, save_file

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.comm.context import DistContext
from specray.models.drafter_presets import write_drafter_for
from specray.models.drafters.mtp import load_mtp_drafter
from specray.workers.worker import load_model

TOL = dict(rtol=1e-4, atol=1e-5)  # see the module docstring
TOKENS = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45, 200, 13, 14, 15]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for family in ("llama", "qwen3", "qwen3_next"):
        layers = {} if family == "qwen3_next" else dict(num_hidden_layers=3)  # its own 4 layer types
        path = make_checkpoint(family, root / family, seed=3, **layers)
        out[family] = path, load_model(path, DistContext.single(), "float32"), load_reference(path)
    return out


def _layer_class(hf_target):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    definitions = speculators_module("speculators.models.mtp.model_definitions")
    if hf_target.config.model_type == "qwen3":
        return definitions.Qwen3MTPLayer
    if hf_target.config.model_type == "qwen3_next":  # over its last full-attention layer (gated attention, MoE)
        return definitions.Qwen3NextMTPLayer
    return definitions._create_mtp_layer_class("LlamaMTPLayer", LlamaDecoderLayer, LlamaRMSNorm)


def _stacked_experts(state: dict, num_experts: int) -> dict:
    """Per-expert gate/up/down tensors (the checkpoint's names) as transformers' stacked experts:
    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    per = [{n: state.pop(f"mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down")}
           for e in range(num_experts)]
    return dict(state, **{"mlp.experts.gate_up_proj": torch.stack([torch.cat([p["gate"], p["up"]]) for p in per]),
                          "mlp.experts.down_proj": torch.stack([p["down"] for p in per])})


def _reference_module(w: dict, cfg: dict, hf_target, i: int):
    """speculators' MTP layer holding module i's weights, and its output head (logits, fed back)."""
    deepseek = "num_nextn_predict_layers" in cfg
    block = f"model.layers.{cfg['num_hidden_layers'] + i}." if deepseek else f"mtp.layers.{i}."
    names = ("enorm", "hnorm", "eh_proj", "shared_head.norm") if deepseek else (
        "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.fc", "mtp.norm")
    own = (lambda n: w[f"{block}{n}.weight"]) if deepseek else (lambda n: w[f"{n}.weight"])
    # Qwen3-Next's norms are x * (1 + w): a plain RMSNorm holds 1 + w; Qwen3NextRMSNorm applies it itself
    is_zero_centred = not deepseek and hf_target.config.model_type != "qwen3_next"
    centre = (lambda t: 1.0 + t) if is_zero_centred else (lambda t: t)
    state = {n[len(block):]: t for n, t in w.items()
             if n.startswith(block) and not n[len(block):].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))}
    state.update({"token_layernorm.weight": centre(own(names[0])), "hidden_layernorm.weight": centre(own(names[1])),
                  "input_proj.weight": own(names[2]), "final_layernorm.weight": centre(own(names[3]))})
    config = hf_target.config
    config._attn_implementation = "sdpa"
    layer = _layer_class(hf_target)(config, layer_idx=0)
    if "mlp.experts.gate_up_proj" in layer.state_dict():  # transformers 5 holds experts stacked
        state = _stacked_experts(state, config.num_experts)
    layer.load_state_dict(state)
    layer.eval()
    if not deepseek:  # the layer's output is normed, fed back, and read by the target's LM head
        return layer, lambda out: (F.linear(out, hf_target.lm_head.weight), out)
    # DeepSeek-V3: the layer's final norm is shared_head.norm; the pre-norm output is fed back
    shared_norm, layer.final_layernorm = layer.final_layernorm, torch.nn.Identity()
    head = w[f"{block}shared_head.head.weight"]
    return layer, lambda g: (F.linear(shared_norm(g), head), g)


def mtp_reference(path: Path, hf_target, tokens, features, k):
    from transformers import DynamicCache

    cfg = json.loads((path / "config.json").read_text())
    w = load_file(path / "model.safetensors")
    n = cfg.get("num_nextn_predict_layers") or cfg["mtp_num_hidden_layers"]
    modules = [_reference_module(w, cfg, hf_target, i) for i in range(min(n, k))]
    caches = [DynamicCache(config=hf_target.config) for _ in modules]
    rotary = hf_target.model.rotary_emb

    def run(m, ids, h, start):
        layer, head = modules[m]
        emb, pos = hf_target.model.embed_tokens(ids)[None], torch.arange(start, start + len(ids))[None]
        out = layer(hidden_states=h[None], token_embeddings=emb, position_ids=pos, cache=caches[m],
                    use_cache=True, position_embeddings=rotary(emb, pos))
        return head(out[0, -1:])

    with torch.no_grad():
        firsts = [run(m, torch.tensor(tokens[1:]), features, 0) for m in range(len(modules))]
        logits, h = firsts[0]
        out = [logits[0]]
        for j in range(1, k):
            logits, h = run(min(j, len(modules) - 1), out[-1].argmax()[None], h, len(tokens) - 2 + j)
            out.append(logits[0])
    out = torch.stack(out)
    return out.argmax(-1).tolist(), out


@pytest.mark.parametrize("family, layout, num_modules, k", [
    ("llama", "deepseek_v3", 1, 4),
    ("qwen3", "qwen3_next", 1, 3),
    ("qwen3_next", "qwen3_next", 1, 3),  # the hybrid target's own: gated attention and a shared-expert MoE
    ("qwen3_next", "qwen3_next", 2, 3),
    ("llama", "deepseek_v3", 2, 3),  # draft 0 module 0, drafts 1 and 2 module 1 (k above n reuses the last)
    ("qwen3", "deepseek_v3", 2, 1),  # k = 1: only module 0 runs
])
def test_mtp_drafts_equal_speculators_reference(targets, tmp_path, family, layout, num_modules, k):
    target_dir, model, hf = targets[family]
    path = write_drafter_for(target_dir, "mtp", tmp_path / "mtp", seed=1, num_modules=num_modules, layout=layout)
    drafter = load_mtp_drafter(path, k, DistContext.single(), "float32", model)
    assert (drafter.fmt.layout, drafter.fmt.num_modules, len(drafter.mtp)) == (layout, num_modules, min(k, num_modules))
    with torch.no_grad():
        features = hf.model(torch.tensor([TOKENS])).last_hidden_state[0, :-1]  # after the final norm
    drafts, logits = propose(drafter, TOKENS, features, k, empty_pools(drafter, len(drafter.mtp)))
    ref_drafts, ref_logits = mtp_reference(path, hf, TOKENS, features, k)
    assert drafts == ref_drafts
    torch.testing.assert_close(logits, ref_logits, **TOL)


@pytest.mark.parametrize("family, fused_rows", [("llama", [1, 1, 7, 7, 1, 1]), ("qwen3", [])])
def test_the_fused_block_proposes_the_module_paths_drafts(targets, tmp_path, monkeypatch, family, fused_rows):
    """A dense GQA block in fused_layer.c's two blocks (issue 29) against the same block module by module on the
    same kernels (SPECRAY_CPU_FUSED_LAYERS=0): the same drafts and K/V over two steps of two modules, logits within
    TOL (the fused MLP's silu is specray_silu_mul's). Taken wherever the rows allow (the first step's prompt goes to
    SDPA); never for a block with q/k norms (Qwen3), which the kernels do not run."""
    from specray.models.drafters import mtp

    target_dir, model, hf = targets[family]
    path = write_drafter_for(target_dir, "mtp", tmp_path / "mtp", seed=1, num_modules=2, layout="deepseek_v3")
    drafter = load_mtp_drafter(path, 3, DistContext.single(), "float32", model)
    with torch.no_grad():
        features = hf.model(torch.tensor([TOKENS])).last_hidden_state[0, :-1]
    rows, real = [], mtp.add_mlp_block
    monkeypatch.setattr(mtp, "add_mlp_block", lambda kernels, row, shape, eps, x, *a: rows.append(x.shape[0])
                        or real(kernels, row, shape, eps, x, *a))

    def two_steps():
        pools = empty_pools(drafter, 2)
        first = propose(drafter, TOKENS[:17], features[:16], 3, pools)
        return first, propose(drafter, TOKENS, features[16:], 3, pools, consumed=16), pools
    fused = two_steps()
    assert rows == fused_rows
    monkeypatch.setenv("SPECRAY_CPU_FUSED_LAYERS", "0")
    module = two_steps()
    assert len(rows) == len(fused_rows)  # the module path took no fused block
    for (fused_drafts, fused_logits), (module_drafts, module_logits) in zip(fused[:2], module[:2]):
        assert fused_drafts == module_drafts
        torch.testing.assert_close(fused_logits, module_logits, **TOL)
    for fused_pool, module_pool in zip(fused[2], module[2], strict=True):
        torch.testing.assert_close(fused_pool, module_pool, **TOL)


# --------------------------------------------------------------------------- bad input


def _edit(path: Path, out: Path, drop=(), **config) -> Path:
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop:
        w = load_file(out / "model.safetensors")
        save_file({n: t for n, t in w.items() if n not in drop}, out / "model.safetensors")
    return out


def _load(path, targets, family="llama"):
    return load_mtp_drafter(Path(path), 3, DistContext.single(), "float32", targets[family][1])


def test_mtp_on_a_target_without_mtp_weights_names_the_checkpoint_and_the_keys(targets):
    target_dir = targets["llama"][0]
    with pytest.raises(ValueError, match=r"has none: its config.json has neither num_nextn_predict_layers .*"
                                         r"nor mtp_num_hidden_layers") as info:
        _load(target_dir, targets)
    assert str(target_dir) in str(info.value)
    config = EngineConfig(model="tiny-llama", spec=SpecConfig(method="mtp"), kv=KVConfig(capacity_tokens=1024))
    with pytest.raises(ValueError, match="tiny-llama-seed0.*has none.*<preset>-mtp"):
        LLM(config)


@pytest.mark.parametrize("layout, drop", [("deepseek_v3", "model.layers.3.eh_proj.weight"),
                                          ("deepseek_v3", "model.layers.3.self_attn.q_proj.weight"),
                                          ("qwen3_next", "mtp.pre_fc_norm_hidden.weight")])
def test_missing_mtp_tensors_are_named(targets, tmp_path, layout, drop):
    path = write_drafter_for(targets["llama"][0], "mtp", tmp_path / "full", layout=layout)
    with pytest.raises(ValueError, match=rf"missing \['{drop}'\]"):
        _load(_edit(path, tmp_path / "bad", drop=(drop,)), targets)


def test_mtp_weights_of_another_target_are_rejected(targets, tmp_path):
    path = write_drafter_for(targets["qwen3"][0], "mtp", tmp_path / "qwen3-mtp")
    with pytest.raises(ValueError, match=r"is not the target's: \['architecture Qwen3ForCausalLM \(target Llama"):
        _load(path, targets)


def test_the_retired_specray_format_says_what_to_convert_to(targets, tmp_path):
    path = write_drafter_for(targets["llama"][0], "mtp", tmp_path / "full")
    old = _edit(path, tmp_path / "old", architectures=["SpecrayMTPDrafter"])
    with pytest.raises(ValueError, match=r"'SpecrayMTPDrafter', which is deprecated .* convert it to the target "
                                         r"checkpoint's own MTP layout: DeepSeek-V3 .* or Qwen3-Next"):
        _load(old, targets)


# --------------------------------------------------------------------------- in the engine

PROMPTS = [list(range(3, 3 + n)) for n in (5, 61, 30)]  # prompt + 40 tokens crosses 32/64-token pages
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def engine(model, method=None, k=3, page=32, tp=1, moe_ep=None, draft=None) -> EngineConfig:
    parallel = ParallelConfig(tp_size=tp, moe_ep_size=moe_ep, launcher="mp" if tp > 1 else "local",
                              check_every_step=tp > 1, timeout_s=60.0)
    return EngineConfig(model=model, kv=KVConfig(tokens_per_block=page, capacity_tokens=4096), parallel=parallel,
                        spec=SpecConfig(method=method, num_draft_tokens=k, draft_model=draft))


@pytest.fixture(scope="module")
def plain():
    out = {}
    for name in ("tiny-llama", "tiny-moe"):
        with LLM(engine(name)) as llm:
            out[name] = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return out


def _check(config, expected, num_mtp_layers):
    with LLM(config) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert list(llm.geometry) == ["target"]  # one-model: no draft pool
        assert llm.geometry["target"].num_layers == 4 + num_mtp_layers  # the tiny presets have 4 layers
    assert [o.token_ids for o in outs] == expected
    assert all(o.metrics["num_verify_steps"] > 0 for o in outs)


@pytest.mark.parametrize("page", [16, 32, 64])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_mtp_preset_is_lossless(plain, k, page):
    _check(engine("tiny-llama-mtp", "mtp", k, page), plain["tiny-llama"], 1)


def test_the_mtp_preset_is_the_target_preset_plus_its_module(plain):
    with LLM(engine("tiny-llama-mtp")) as llm:  # loaded as a target, it decodes as tiny-llama
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain["tiny-llama"]
    from specray.models.presets import materialize

    cfg = json.loads((materialize("tiny-llama-mtp") / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 4


@pytest.mark.parametrize("page", [16, 32, 64])
def test_mtp_is_lossless_at_tp2(plain, page):
    _check(engine("tiny-llama-mtp", "mtp", 3, page, tp=2), plain["tiny-llama"], 1)


def test_mtp_moe_block_with_expert_parallelism_is_lossless(plain):
    _check(engine("tiny-moe-mtp", "mtp", 3, 32, tp=2, moe_ep=2), plain["tiny-moe"], 1)


@pytest.mark.parametrize("layout, num_modules, k, page", [("qwen3_next", 1, 3, 64), ("deepseek_v3", 2, 7, 32),
                                                          ("deepseek_v3", 2, 3, 64)])
def test_both_layouts_and_several_modules_are_lossless(plain, tmp_path, layout, num_modules, k, page):
    from specray.models.presets import materialize

    path = write_drafter_for(materialize("tiny-llama"), "mtp", tmp_path / "mtp", num_modules=num_modules,
                             layout=layout)
    _check(engine("tiny-llama", "mtp", k, page, draft=str(path)), plain["tiny-llama"], min(k, num_modules))
