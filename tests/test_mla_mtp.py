"""DeepSeek-V3's MTP modules on MLA targets (DeepSeek-V3 and Kimi-K2 shapes): drafts against
transformers' own MTP layer, and losslessness in the engine at k = 1, 3, 7, TP 1 and 2.

Reference: transformers' ``MtpLayer`` (``modeling_layers``, what ``generate(use_mtp=True)``
runs) over its ``DeepseekV3DecoderLayer``: ``eh_proj([enorm(emb); hnorm(h)])``, then the
block. Its ``MtpModel.from_pretrained`` reads DeepSeek-V3's own ``model.layers.61`` names only,
so the test builds the layer directly and loads module i's tensors (``model.layers.{L}.*``)
into it; it leaves DeepSeek-V3's head to the caller, as the published equations do: logits
``shared_head.head(shared_head.norm(g))`` and the pre-norm g fed back.

Losslessness needs drafts that are sometimes right: the checkpoints' MTP module is an
early exit of the target (its block is a copy of target layer 1, an MLA + MoE block, on the
token's embedding; its head the target's final norm and LM head), so drafts are accepted
often but not always, and the tests assert both happen.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import load_reference, make_checkpoint, reference_greedy
from safetensors.torch import load_file

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.comm.context import DistContext
from specray.kv.geometry import PoolGeometry, allocate_pool
from specray.models.checkpoint_writer import write_checkpoint
from specray.models.drafter_presets import write_drafter_for
from specray.models.drafters.mtp import load_mtp_drafter
from specray.models.loader import load_model
from drafter_checkpoints import PAGE, propose

TOL = dict(rtol=1e-4, atol=1e-5)  # float32 both sides, another operation order (test_mtp.py)
TOKENS = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45, 200, 13, 14, 15]
SHAPES = ("deepseek_v3", "kimi_k2")


def write_early_exit_mtp(target_dir: Path, out: Path, block_layer: int = 1) -> Path:
    """The target plus one DeepSeek-V3 MTP module that copies target layer ``block_layer`` as its
    block, reads only the token's embedding (eh_proj = [I | 0]) and the target's head."""
    cfg = json.loads((target_dir / "config.json").read_text())
    w = load_file(target_dir / "model.safetensors")
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    src, dst = f"model.layers.{block_layer}.", f"model.layers.{n}."
    w.update({dst + name[len(src):]: t.clone() for name, t in w.items() if name.startswith(src)})
    w.update({f"{dst}enorm.weight": torch.ones(h), f"{dst}hnorm.weight": torch.ones(h),
              f"{dst}eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
              f"{dst}shared_head.norm.weight": w["model.norm.weight"].clone(),
              f"{dst}shared_head.head.weight": w["lm_head.weight"].clone()})
    write_checkpoint(out, dict(cfg, num_nextn_predict_layers=1), w)
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    out = {}
    for shape in SHAPES:
        root = tmp_path_factory.mktemp(shape)
        directory = make_checkpoint(shape, root / "target", seed=3)
        out[shape] = directory, load_reference(directory), write_early_exit_mtp(directory, root / "early-exit")
    return out


def _reference_layer(w: dict, hf_target, prefix: str):
    """transformers' MtpLayer holding the module at ``prefix`` (DeepSeek-V3 names), and its head."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    config = copy.deepcopy(hf_target.config)
    config._attn_implementation = "sdpa"
    config.first_k_dense_replace = 0  # the block is MoE, as layer index 0 of its own cache
    layer = MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layer_idx=0, use_post_norm=False)
    own = {n[len(prefix):]: t for n, t in w.items() if n.startswith(prefix)}
    state = {k: own[k] for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight")}
    experts = sorted({int(k.split(".")[2]) for k in own if k.startswith("mlp.experts.")})
    for k, t in own.items():
        if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "mlp.experts.")):
            state[f"mtp_block.{k}"] = t
    if experts:  # transformers holds the experts as 3-d tensors
        def expert(e: int, name: str) -> torch.Tensor:
            return own[f"mlp.experts.{e}.{name}.weight"]

        state["mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in experts])
        state["mtp_block.mlp.experts.down_proj"] = torch.stack([expert(e, "down_proj") for e in experts])
    layer.load_state_dict(state)
    norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    norm.weight.data.copy_(own["shared_head.norm.weight"])
    head = own["shared_head.head.weight"]
    return layer.eval(), lambda g: (F.linear(norm(g), head), g)


def mtp_reference(path: Path, hf_target, tokens: list[int], features: torch.Tensor, k: int):
    from transformers import DynamicCache

    cfg = json.loads((path / "config.json").read_text())
    layer, head = _reference_layer(load_file(path / "model.safetensors"), hf_target,
                                   f"model.layers.{cfg['num_hidden_layers']}.")
    cache = DynamicCache(config=hf_target.config)
    rotary = hf_target.model.rotary_emb

    def run(ids, h, start):
        emb, pos = hf_target.model.embed_tokens(ids)[None], torch.arange(start, start + len(ids))[None]
        out = layer(emb, h[None], rotary(emb, pos), None, pos, cache)
        return head(out[0, -1:])

    with torch.no_grad():
        logits, h = run(torch.tensor(tokens[1:]), features, 0)
        out = [logits[0]]
        for j in range(1, k):
            logits, h = run(out[-1].argmax()[None], h, len(tokens) - 2 + j)
            out.append(logits[0])
    out = torch.stack(out)
    return out.argmax(-1).tolist(), out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_equal_transformers_mtp_layer(targets, tmp_path, shape, k):
    target_dir, hf, _ = targets[shape]
    path = write_drafter_for(target_dir, "mtp", tmp_path / "mtp", seed=1)  # seeded random module: MLA + MoE
    model = load_model(target_dir, DistContext.single(), "float32")
    drafter = load_mtp_drafter(path, k, DistContext.single(), "float32", model)
    assert drafter.fmt.is_moe == (True,) and drafter.kv_layout.kind == "latent"
    layout = drafter.kv_layout
    pools = allocate_pool(PoolGeometry(tokens_per_block=PAGE, num_blocks=8, num_layers=1, num_kv_heads=1,
                                       head_dim=layout.head_dim, dtype="float32", kind="latent"), torch.device("cpu"))
    with torch.no_grad():
        features = hf.model(torch.tensor([TOKENS])).last_hidden_state[0, :-1]  # after the final norm
    drafts, logits = propose(drafter, TOKENS, features, k, pools)
    ref_drafts, ref_logits = mtp_reference(path, hf, TOKENS, features, k)
    assert drafts == ref_drafts
    torch.testing.assert_close(logits, ref_logits, **TOL)


PROMPTS = [list(range(3, 3 + n)) for n in (5, 61, 30)]  # prompt + 48 tokens crosses 32-token pages
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def plain(targets):
    """transformers' greedy continuation of every prompt, per shape: the lossless reference."""
    return {shape: [reference_greedy(hf, p, NEW_TOKENS) for p in PROMPTS] for shape, (_, hf, _) in targets.items()}


def _run_mtp(model: Path, k: int, tp: int):
    parallel = ParallelConfig(tp_size=tp, moe_ep_size=tp, launcher="mp" if tp > 1 else "local",
                              check_every_step=tp > 1, timeout_s=60.0)
    config = EngineConfig(model=str(model), kv=KVConfig(tokens_per_block=32, capacity_tokens=4096),
                          parallel=parallel, spec=SpecConfig(method="mtp", num_draft_tokens=k))
    with LLM(config) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        return outs, llm.geometry


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("shape", SHAPES)
def test_mtp_on_mla_targets_is_lossless_at_tp1_and_tp2(targets, plain, shape, k):
    _, _, mtp_dir = targets[shape]
    accepted_counts = []
    for tp in (1, 2):  # TP 2 also splits the module's MoE block over EP 2
        outs, geometry = _run_mtp(mtp_dir, k, tp)
        assert [o.token_ids for o in outs] == plain[shape]
        # the module's KV is one more latent layer of the target pool (3 layers + 1)
        assert list(geometry) == ["target"]
        assert (geometry["target"].kind, geometry["target"].num_layers) == ("latent", 4)
        steps = sum(o.metrics["num_verify_steps"] for o in outs)
        accepted = [o.metrics["num_accepted_tokens"] for o in outs]
        assert 0 < sum(accepted) < steps * k  # drafts were accepted and rejected: both paths ran
        accepted_counts.append(accepted)
    assert accepted_counts[0] == accepted_counts[1]  # the sharded drafter drafts what the unsharded one does


def test_tiny_deepseek_v3_preset_carries_its_mtp_module():
    prompt = [list(range(10, 50))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(EngineConfig(model="tiny-deepseek-v3", kv=KVConfig(capacity_tokens=512))) as llm:
        expected = [o.token_ids for o in llm.generate(prompt, params)]
    with LLM(EngineConfig(model="tiny-deepseek-v3", kv=KVConfig(capacity_tokens=512),
                          spec=SpecConfig(method="mtp", num_draft_tokens=3))) as llm:
        outs = llm.generate(prompt, params)
        assert llm.geometry["target"].num_layers == 4 + 1  # 4 layers and the module, latent rows of 64 + 16
        assert (llm.geometry["target"].kind, llm.geometry["target"].head_dim) == ("latent", 80)
    assert [o.token_ids for o in outs] == expected
