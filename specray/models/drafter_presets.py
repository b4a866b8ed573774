"""Drafter presets matching the target presets: ``<target>-draft`` (draft_model),
``<target>-dflash``, ``<target>-eagle3`` and ``<target>-mtp``.

Written as real checkpoint directories by ``presets.materialize`` like the target presets.

- ``<target>-draft``: a one-layer causal LM of the target's family and vocabulary made of
  the target preset's own seeded embedding, first layer, final norm and LM head (an
  early-exit copy). How often it agrees with the target depends on the model, as measured:
  for the tests' small transformers-built checkpoints (hidden 64, vocab 384), often but not
  always, so partial acceptance and rollback both happen; for the presets (mid-llama and
  the tiny ones), almost never (acceptance length 1.00-1.02), so benchmarks use forced
  acceptance to measure the engine at a chosen acceptance length.
- the heads: seeded random weights (N(0, 0.02) matrices, norms near 1) sized from the target's
  architecture: ``-eagle3`` in EAGLE-3's published format as SpecForge writes it
  (``LlamaForCausalLMEagle3``, ``midlayer.*``; ``eagle3_config(layout="speculators")`` gives
  speculators' ``Eagle3Speculator`` layout), ``-dflash`` as z-lab writes it
  (``DFlashDraftModel``).
- ``<target>-mtp``: not a separate drafter but the target itself with MTP modules, as
  DeepSeek-V3 ships them (``num_nextn_predict_layers``, ``model.layers.{L}.*``; mtp_format.py):
  the target preset's config and weights plus one module of seeded random weights whose
  ``shared_head.head`` is a copy of the target's LM head. Loaded as a target it decodes
  exactly as the target preset; ``--spec mtp`` reads its modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specray.models.arch import ModelArch, arch_from_hf_config
from specray.models.checkpoint_writer import random_weights, write_checkpoint
from specray.models.hybrid_arch import kimi_config, kimi_layer_types, read_mlp_layer_types

DRAFTER_SUFFIXES = {"draft_model": "draft", "dflash": "dflash", "dspark": "dspark", "eagle3": "eagle3", "mtp": "mtp"}
HEAD_SEED_OFFSET = {"dflash": 1, "eagle3": 2, "mtp": 3, "dspark": 4}  # distinct weights per head kind
# cached drafter presets written before the published formats (and, "2", before -mtp became the
# target with its own MTP modules) are not reused
PRESET_FORMAT_TAG = "-published2"


def feature_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high target layer outputs (EAGLE-3's choice, scaled to small models)."""
    return sorted({0, num_layers // 2, num_layers - 1})


def _layer_sizes(target: ModelArch) -> dict:
    return dict(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                intermediate_size=target.intermediate_size or 4 * target.hidden_size,
                num_attention_heads=target.num_heads, num_key_value_heads=target.num_kv_heads,
                head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                max_position_embeddings=target.max_position_embeddings, attention_bias=False)


def eagle3_config(target: ModelArch, layout: str = "specforge", draft_vocab_size: int | None = None) -> dict:
    """EAGLE-3's config.json as SpecForge writes it (aux ids nested in ``eagle_config``: layer
    outputs) or as ``speculators`` writes it (top-level aux ids: layers entered)."""
    outputs = feature_layer_ids(target.num_layers)
    layer = dict(_layer_sizes(target), num_hidden_layers=1)
    draft_vocab = draft_vocab_size or target.vocab_size
    if layout == "specforge":
        return dict(layer, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                    draft_vocab_size=draft_vocab, target_hidden_size=target.hidden_size,
                    eagle_config={"eagle_aux_hidden_state_layer_ids": outputs, "use_aux_hidden_state": True})
    return dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3",
                transformer_layer_config=dict(layer, model_type="llama", architectures=["LlamaForCausalLM"]),
                draft_vocab_size=draft_vocab, norm_before_residual=False, target_hidden_size=target.hidden_size,
                eagle_aux_hidden_state_layer_ids=[i + 1 for i in outputs],
                speculators_config={"algorithm": "eagle3", "default_proposal_method": "greedy",
                                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                    "verifier": {"name_or_path": None, "architectures": [target.architecture]}})


def dflash_config(target: ModelArch, block_size: int = 16) -> dict:
    """DFlash's config.json as z-lab writes it: Qwen3 layer sizes plus ``dflash_config``."""
    return dict(_layer_sizes(target), architectures=["DFlashDraftModel"], model_type="qwen3",
                num_hidden_layers=2, num_target_layers=target.num_layers, block_size=block_size,
                dflash_config={"mask_token_id": target.vocab_size - 1,
                               "target_layer_ids": feature_layer_ids(target.num_layers)})


def dspark_config(target: ModelArch, block_size: int = 8, draft_vocab_size: int | None = None,
                  markov_head_type: str = "vanilla", algorithm: str = "dspark") -> dict:
    """DSpark's config.json as ``speculators`` writes it (aux ids: layers entered); with
    ``algorithm="dflash"``, speculators' DFlash (the same backbone, no heads)."""
    layer = dict(_layer_sizes(target), num_hidden_layers=2, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    if algorithm == "dflash":
        return dict(architectures=["DFlashSpeculator"], speculators_model_type="dflash",
                    transformer_layer_config=layer, draft_vocab_size=draft_vocab_size or target.vocab_size,
                    block_size=block_size, target_hidden_size=target.hidden_size, mask_token_id=target.vocab_size - 1,
                    aux_hidden_state_layer_ids=[i + 1 for i in feature_layer_ids(target.num_layers)],
                    sample_from_anchor=False)
    return dict(architectures=["DSparkSpeculator"], speculators_model_type="dspark", transformer_layer_config=layer,
                draft_vocab_size=draft_vocab_size or target.vocab_size, block_size=block_size,
                target_hidden_size=target.hidden_size, mask_token_id=target.vocab_size - 1,
                aux_hidden_state_layer_ids=[i + 1 for i in feature_layer_ids(target.num_layers)],
                sample_from_anchor=True, markov_rank=16, markov_head_type=markov_head_type,
                enable_confidence_head=True, confidence_head_with_markov=True,
                speculators_config={"algorithm": "dspark", "default_proposal_method": "greedy",
                                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size}],
                                    "verifier": {"name_or_path": None, "architectures": [target.architecture]}})


def _draft_vocab(w: dict, vocab: int, draft_vocab: int, gen) -> None:
    """d2t (draft id i -> target id i + d2t[i]) and t2d over a sorted random subset of the vocabulary."""
    kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    w["d2t"] = kept - torch.arange(draft_vocab)
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, kept, True)


def _layer_weights(prefix: str, sizes: dict, attn_in: int, qk_norm: bool, normal, norm) -> dict[str, torch.Tensor]:
    h, inter, hd = sizes["hidden_size"], sizes["intermediate_size"], sizes["head_dim"]
    nh, nkv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    w = {f"{prefix}.input_layernorm.weight": norm(h), f"{prefix}.post_attention_layernorm.weight": norm(h),
         f"{prefix}.self_attn.q_proj.weight": normal(nh * hd, attn_in),
         f"{prefix}.self_attn.k_proj.weight": normal(nkv * hd, attn_in),
         f"{prefix}.self_attn.v_proj.weight": normal(nkv * hd, attn_in),
         f"{prefix}.self_attn.o_proj.weight": normal(h, nh * hd),
         f"{prefix}.mlp.gate_proj.weight": normal(inter, h), f"{prefix}.mlp.up_proj.weight": normal(inter, h),
         f"{prefix}.mlp.down_proj.weight": normal(h, inter)}
    if qk_norm:
        w.update({f"{prefix}.self_attn.q_norm.weight": norm(hd), f"{prefix}.self_attn.k_norm.weight": norm(hd)})
    return w


def head_weights(method: str, cfg: dict, seed: int, with_embed: bool = False) -> dict[str, torch.Tensor]:
    """Seeded random weights (N(0, 0.02) matrices, norms near 1) in the method's published names."""
    gen = torch.Generator().manual_seed(seed * 16 + HEAD_SEED_OFFSET[method])

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 5 * normal(size)

    sizes = cfg.get("transformer_layer_config", cfg)
    h, vocab = sizes["hidden_size"], sizes["vocab_size"]
    if method == "dspark" or cfg.get("speculators_model_type") == "dflash":
        return _dspark_weights(cfg, gen, normal, norm)
    if method == "dflash":
        ids = cfg["dflash_config"]["target_layer_ids"]
        w = {"fc.weight": normal(h, len(ids) * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
        for i in range(cfg["num_hidden_layers"]):
            w.update(_layer_weights(f"layers.{i}", cfg, h, True, normal, norm))
        return w
    if method == "eagle3":
        prefix = "layers.0" if "transformer_layer_config" in cfg else "midlayer"
        num_aux = len(cfg.get("eagle_aux_hidden_state_layer_ids")
                      or cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"))
        draft_vocab = cfg["draft_vocab_size"]
        w = {"fc.weight": normal(h, num_aux * cfg["target_hidden_size"]), "norm.weight": norm(h),
             "lm_head.weight": normal(draft_vocab, h), f"{prefix}.hidden_norm.weight": norm(h),
             **_layer_weights(prefix, sizes, 2 * h, False, normal, norm)}
        if draft_vocab != vocab:
            _draft_vocab(w, vocab, draft_vocab, gen)
        if with_embed:
            w["embed_tokens.weight"] = normal(vocab, h)
        return w
    raise ValueError(f"no head weights for method {method!r}")


def _dspark_weights(cfg: dict, gen, normal, norm) -> dict[str, torch.Tensor]:
    sizes = cfg["transformer_layer_config"]
    h, vocab, draft_vocab, r = sizes["hidden_size"], sizes["vocab_size"], cfg["draft_vocab_size"], cfg.get("markov_rank")
    w = {"fc.weight": normal(h, len(cfg["aux_hidden_state_layer_ids"]) * h), "hidden_norm.weight": norm(h),
         "norm.weight": norm(h)}
    if r:
        w.update({"markov_head.markov_w1.weight": normal(vocab, r) * 50,
                  "markov_head.markov_w2.weight": normal(draft_vocab, r), "confidence_head.proj.weight": normal(1, h + r),
                  "confidence_head.proj.bias": normal(1)})
    for i in range(sizes["num_hidden_layers"]):
        w.update(_layer_weights(f"layers.{i}", sizes, h, True, normal, norm))
    if r and cfg["markov_head_type"] == "gated":
        w.update({"markov_head.gate_proj.weight": normal(r, h + r) * 50, "markov_head.gate_proj.bias": normal(r)})
    if draft_vocab != vocab:
        w["lm_head.weight"] = normal(draft_vocab, h)
        _draft_vocab(w, vocab, draft_vocab, gen)
    return w


def head_config(method: str, target: ModelArch) -> dict:
    """The config.json of a head preset: published formats for eagle3 and dflash."""
    if method == "eagle3":
        return eagle3_config(target)
    if method == "dflash":
        return dflash_config(target)
    if method == "dspark":
        return dspark_config(target)
    raise ValueError(f"no head config for method {method!r} (mtp: see mtp_checkpoint)")


def mtp_checkpoint(target_cfg: dict, target_weights: dict[str, torch.Tensor], seed: int, num_modules: int = 1,
                   layout: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The target with ``num_modules`` MTP modules of seeded random weights, in DeepSeek-V3's
    layout (``model.layers.{L}.*``) or Qwen3-Next's (``mtp.*``, zero-centred norms near 0); by
    default the layout the target's own family ships (Qwen3-Next's for a Qwen3-Next target)."""
    if layout is None:
        layout = "qwen3_next" if target_cfg.get("model_type") == "qwen3_next" else "deepseek_v3"
    n, h = target_cfg["num_hidden_layers"], target_cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed * 16 + HEAD_SEED_OFFSET["mtp"])

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    # decoder blocks of the target's family (dense or MoE), numbered after the target's layers; a hybrid
    # target's MTP blocks are full-attention layers (Qwen3-Next's are gated attention)
    block_cfg = dict(target_cfg, num_hidden_layers=n + num_modules)
    if target_cfg.get("layer_types"):
        block_cfg["layer_types"] = list(target_cfg["layer_types"]) + ["full_attention"] * num_modules
    blocks = random_weights(block_cfg, seed * 16 + HEAD_SEED_OFFSET["mtp"])
    w = dict(target_weights)
    head = target_weights.get("lm_head.weight", target_weights["model.embed_tokens.weight"])
    for i in range(num_modules):
        old = f"model.layers.{n + i}."
        new = old if layout == "deepseek_v3" else f"mtp.layers.{i}."
        w.update({new + name[len(old):]: t for name, t in blocks.items() if name.startswith(old)})
        if layout == "deepseek_v3":
            w.update({f"{old}enorm.weight": 1.0 + 5 * normal(h), f"{old}hnorm.weight": 1.0 + 5 * normal(h),
                      f"{old}eh_proj.weight": normal(h, 2 * h), f"{old}shared_head.norm.weight": 1.0 + 5 * normal(h),
                      f"{old}shared_head.head.weight": head.clone()})
    if layout == "deepseek_v3":
        return dict(target_cfg, num_nextn_predict_layers=num_modules), w
    w.update({"mtp.pre_fc_norm_embedding.weight": 5 * normal(h), "mtp.pre_fc_norm_hidden.weight": 5 * normal(h),
              "mtp.fc.weight": normal(h, 2 * h), "mtp.norm.weight": 5 * normal(h)})
    return dict(target_cfg, mtp_num_hidden_layers=num_modules), w


MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def early_exit_weights(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Keep the embedding, head, final norm and the first ``num_layers`` decoder layers."""
    def kept(name: str) -> bool:
        if not name.startswith("model.layers."):
            return True
        return int(name.split(".")[2]) < num_layers

    return {name: t for name, t in weights.items() if kept(name)}


def early_exit_draft(cfg: dict, weights: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of a one-layer draft model cut from a target: its first layer, or for a
    hybrid target its first full-attention layer renumbered 0, since a draft model keeps its KV in
    a paged pool and has no state slots (``draft_model.py``)."""
    # the target's MTP modules stay behind (DeepSeek-V3's, numbered after the layers, are cut with them)
    cfg = {key: value for key, value in cfg.items() if key not in MTP_CONFIG_KEYS}
    weights = {name: t for name, t in weights.items() if not name.startswith("mtp.")}
    types = hybrid_layer_types(cfg)
    if not types or "full_attention" not in types:
        draft = dict(cfg, num_hidden_layers=1)
        draft.pop("layer_types", None)
        return draft, early_exit_weights(weights, 1)
    layer = types.index("full_attention")
    prefix = f"model.layers.{layer}."
    kept = {name.replace(prefix, "model.layers.0.", 1): t for name, t in weights.items()
            if name.startswith(prefix) or not name.startswith("model.layers.")}
    return dict(cfg, num_hidden_layers=1, layer_types=["full_attention"], **_one_layer_mlp(cfg, layer)), kept


def hybrid_layer_types(cfg: dict) -> list[str] | None:
    """Each layer's type (full_attention / linear_attention) of a hybrid config, else None."""
    if cfg.get("model_type") == "kimi_linear":  # layer_types, else linear_attn_config's layer lists
        return kimi_layer_types(kimi_config(cfg), "draft")
    return cfg.get("layer_types")


def _one_layer_mlp(cfg: dict, layer: int) -> dict:
    """The config keys that keep ``layer``'s MLP (dense or MoE) as the only layer's."""
    if cfg.get("model_type") == "kimi_linear":
        is_moe = layer in read_mlp_layer_types(kimi_config(cfg), "draft")
        lin = {key: value for key, value in (cfg.get("linear_attn_config") or {}).items()
               if key not in ("kda_layers", "full_attn_layers")}  # layer_types names the one layer
        return dict(mlp_layer_types=["sparse" if is_moe else "dense"], linear_attn_config=lin)
    step = cfg.get("decoder_sparse_step", 1) or 1
    is_moe = layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0
    return dict(mlp_only_layers=[] if is_moe else [0], decoder_sparse_step=1)


def drafter_preset(target_cfg: dict, target_name: str, method: str,
                   seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, weights) of the drafter preset for the target preset ``target_name`` (config ``target_cfg``)."""
    if method == "mtp":
        return mtp_checkpoint(target_cfg, random_weights(target_cfg, seed), seed)
    if method == "draft_model":
        return early_exit_draft(target_cfg, random_weights(target_cfg, seed))
    cfg = head_config(method, arch_from_hf_config(target_cfg, source=target_name))
    return cfg, head_weights(method, cfg, seed)


def write_drafter_for(target_dir: str | Path, method: str, directory: str | Path, seed: int = 0,
                      **options) -> Path:
    """Write a drafter checkpoint matching any target checkpoint directory (tests, custom
    targets): draft_model = the target's early-exit copy, mtp = a copy of the target with one
    MTP module (``options``: num_modules, layout), heads = seeded random weights."""
    target_dir, directory = Path(target_dir), Path(directory)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    weights = {}
    if method in ("draft_model", "mtp"):
        for f in sorted(target_dir.glob("*.safetensors")):
            with safe_open(f, "pt") as handle:
                weights.update({name: handle.get_tensor(name) for name in handle.keys()})
    if method == "mtp":
        write_checkpoint(directory, *mtp_checkpoint(target_cfg, weights, seed, **options))
        return directory
    if method == "draft_model":
        write_checkpoint(directory, *early_exit_draft(target_cfg, weights))
        return directory
    cfg = head_config(method, arch_from_hf_config(target_cfg, source=str(target_dir / "config.json")))
    write_checkpoint(directory, cfg, head_weights(method, cfg, seed))
    return directory
