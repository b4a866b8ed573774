"""The published drafter formats specray reads, detected from the drafter's ``config.json``.

| found in config.json                                   | format                      | method   |
|--------------------------------------------------------|-----------------------------|----------|
| ``architectures: ["LlamaForCausalLMEagle3"]``          | EAGLE-3 as SpecForge/EAGLE  | eagle3   |
|                                                        | write it (``midlayer.*``)   |          |
| ``architectures: ["Eagle3Speculator"]`` or             | EAGLE-3 as ``speculators``  | eagle3   |
| ``speculators_model_type: "eagle3"``                   | writes it (``layers.0.*``)  |          |
| ``architectures: ["DFlashDraftModel"]``                | DFlash as z-lab writes it   | dflash   |
| ``architectures: ["DFlashSpeculator"]`` or             | DFlash as ``speculators``   | dflash   |
| ``speculators_model_type: "dflash"``                   | writes it                   |          |
| ``architectures: ["DSparkSpeculator"]`` or             | DSpark as ``speculators``   | dspark   |
| ``speculators_model_type: "dspark"``                   | writes it                   |          |
| ``SpecrayEagle3Drafter`` / ``SpecrayDFlashDrafter``    | specray's retired formats:  | -        |
|                                                        | a deprecation error         |          |

Which target layers feed EAGLE-3 (the aux-layer convention; docs/drafters.md repeats it):

- top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM, ``speculators``): the residual stream
  *entering* those target layers, i.e. the output of layer ``id - 1``;
- ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge, SGLang): the *outputs* of those
  layers, i.e. the residual stream entering layer ``id + 1``;
- neither: entering layers (2, L // 2, L - 3), vLLM's default for an L-layer target.

DFlash's ``target_layer_ids`` (z-lab) are layer outputs (z-lab reads ``hidden_states[id + 1]``);
``speculators``' ``aux_hidden_state_layer_ids`` (its DFlash and DSpark) are layers entered, like EAGLE-3's
top-level ids (its DFlash converter writes z-lab's id + 1).

specray keeps the outputs-of-layers form (``feature_layers``), which is what the target's
forward captures; an id that means "entering layer 0" (the embedding) is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specray.errors import require_keys
from specray.models.arch import ModelArch, arch_from_hf_config

EAGLE3_SPECFORGE = "LlamaForCausalLMEagle3"
EAGLE3_SPECULATORS = "Eagle3Speculator"
DFLASH = "DFlashDraftModel"
DFLASH_SPECULATORS = "DFlashSpeculator"
DSPARK = "DSparkSpeculator"
FORMAT_METHODS = {EAGLE3_SPECFORGE: "eagle3", EAGLE3_SPECULATORS: "eagle3", DFLASH: "dflash",
                  DFLASH_SPECULATORS: "dflash", DSPARK: "dspark"}
RETIRED = {
    "SpecrayEagle3Drafter": "EAGLE-3 as SpecForge writes it (architectures ['LlamaForCausalLMEagle3'], "
                            "tensors fc, midlayer.*, norm, lm_head, d2t) or as speculators writes it "
                            "(architectures ['Eagle3Speculator'], transformer_layer_config)",
    "SpecrayDFlashDrafter": "DFlash as z-lab writes it (architectures ['DFlashDraftModel'], block_size, "
                            "dflash_config.mask_token_id and target_layer_ids, tensors fc, hidden_norm, "
                            "layers.*, norm)",
}
LAYER_FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True, slots=True)
class Eagle3Format:
    layout: str  # EAGLE3_SPECFORGE or EAGLE3_SPECULATORS
    arch: ModelArch  # the draft layer's sizes (vocab_size: the target's vocabulary)
    layer_prefix: str  # "midlayer" (SpecForge) or "layers.0" (speculators)
    draft_vocab_size: int
    feature_layers: tuple[int, ...]  # outputs of these target layers, in fc's input order
    target_hidden_size: int
    norm_before_residual: bool = False
    norm_output: bool = False


@dataclass(frozen=True, slots=True)
class DFlashFormat:
    arch: ModelArch  # Qwen3 layers (q/k norm); hidden_size is the target's
    block_size: int
    mask_token_id: int
    feature_layers: tuple[int, ...]  # outputs of these target layers
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DSpark (speculators) only:
    draft_vocab_size: int | None = None  # own lm_head over a draft vocabulary (with d2t); None: the target's head
    sample_from_anchor: bool = False  # the anchor's row drafts too: block_size drafts per forward
    markov_rank: int = 0  # the Markov logit-bias head's rank; 0: none
    markov_head_type: str = "vanilla"
    has_confidence_head: bool = False
    confidence_with_markov: bool = False

    @property
    def max_drafts(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1


def detect_format(cfg: dict, source: str) -> str:
    """The format name (a key of FORMAT_METHODS) of a drafter config, or a clear error."""
    archs = cfg.get("architectures") or []
    for name, convert_to in RETIRED.items():
        if name in archs:
            raise ValueError(f"drafter {source!r} is in specray's own format {name!r}, which is deprecated and "
                             f"no longer read; convert it to {convert_to}")
    if cfg.get("speculators_model_type") == "eagle3" or EAGLE3_SPECULATORS in archs:
        return EAGLE3_SPECULATORS
    if cfg.get("speculators_model_type") == "dspark" or DSPARK in archs:
        return DSPARK
    if cfg.get("speculators_model_type") == "dflash" or DFLASH_SPECULATORS in archs:
        return DFLASH_SPECULATORS
    for name in (EAGLE3_SPECFORGE, DFLASH):
        if name in archs:
            return name
    raise ValueError(f"drafter {source!r}: config.json has architectures {archs} "
                     f"(speculators_model_type {cfg.get('speculators_model_type')!r}); expected one of "
                     f"{sorted(FORMAT_METHODS)}")


def eagle3_feature_layers(cfg: dict, num_target_layers: int, source: str) -> tuple[int, ...]:
    """Target layers whose outputs EAGLE-3 reads, from either convention (module docstring)."""
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    entering = [2, num_target_layers // 2, num_target_layers - 3]
    outputs = [i - 1 for i in (top if top is not None else entering)]
    if top is None and nested is not None:
        outputs = list(nested)
    if top is not None and nested is not None and [i - 1 for i in top] != list(nested):
        raise ValueError(f"drafter {source!r}: eagle_aux_hidden_state_layer_ids {top} (layers entered) and "
                         f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (layer outputs) disagree: "
                         f"the nested ids must be the top-level ids minus 1")
    given = (f"eagle_aux_hidden_state_layer_ids {top}" if top is not None else
             f"eagle_config.eagle_aux_hidden_state_layer_ids {nested}" if nested is not None else
             f"the default aux layers (entering {entering})")
    bad = [i for i in outputs if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"drafter {source!r}: {given} name target "
                         f"layer outputs {bad}, outside the target's {num_target_layers} layers (top-level ids "
                         f"must be in [1, {num_target_layers}], nested ids in [0, {num_target_layers - 1}])")
    return tuple(outputs)


def read_eagle3(cfg: dict, target: ModelArch, source: str) -> Eagle3Format:
    """EAGLE-3's architecture from either layout's config, checked against the target."""
    layout = detect_format(cfg, source)
    if layout == EAGLE3_SPECULATORS:
        layer_cfg = dict(cfg.get("transformer_layer_config") or {})
        family = LAYER_FAMILIES.get(layer_cfg.get("model_type", "llama"))
        if family is None:
            raise ValueError(f"drafter {source!r}: transformer_layer_config.model_type "
                             f"{layer_cfg.get('model_type')!r} is not supported; supported: {sorted(LAYER_FAMILIES)}")
        for flag in ("norm_before_fc", "fc_norm"):
            if cfg.get(flag):
                raise ValueError(f"drafter {source!r}: {flag}=true is not supported by specray's eagle3 yet")
        prefix = "layers.0"
    else:
        layer_cfg, family, prefix = dict(cfg), "LlamaForCausalLM", "midlayer"
    arch = arch_from_hf_config(dict(layer_cfg, architectures=[family]), source=_config_file(source))
    if arch.num_layers != 1:
        raise ValueError(f"drafter {source!r}: num_hidden_layers is {arch.num_layers}; specray's eagle3 runs "
                         f"the single EAGLE-3 decoder layer (1)")
    target_hidden = cfg.get("target_hidden_size") or layer_cfg.get("target_hidden_size") or arch.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(f"drafter {source!r} reads target hidden states of size {target_hidden}, but the "
                         f"target's hidden_size is {target.hidden_size}: they must be equal")
    if arch.vocab_size != target.vocab_size:
        raise ValueError(f"drafter {source!r} has vocab_size {arch.vocab_size} (the target vocabulary it maps "
                         f"to) but the target has {target.vocab_size}: they must be equal")
    draft_vocab = cfg.get("draft_vocab_size") or layer_cfg.get("draft_vocab_size") or arch.vocab_size
    return Eagle3Format(layout=layout, arch=arch, layer_prefix=prefix, draft_vocab_size=int(draft_vocab),
                        feature_layers=eagle3_feature_layers(cfg, target.num_layers, source),
                        target_hidden_size=int(target_hidden),
                        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                        norm_output=bool(cfg.get("norm_output", False)))


def _config_file(source: str) -> str:
    """The config.json of a drafter directory, as errors name it."""
    return source if source.endswith("config.json") else f"{source.rstrip('/')}/config.json"


def _dflash_value(cfg: dict, name: str, default=None):
    """z-lab's lookup: ``dflash_config`` first, then the top level."""
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


def dflash_default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default target layers: evenly spread over [1, L - 3] (the middle one for one layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def read_dflash(cfg: dict, target: ModelArch, source: str) -> DFlashFormat:
    """DFlash's architecture from z-lab's config, checked against the target."""
    detect_format(cfg, source)
    arch = arch_from_hf_config(dict(cfg, architectures=["Qwen3ForCausalLM"]), source=_config_file(source))
    if arch.hidden_size != target.hidden_size:
        raise ValueError(f"drafter {source!r} has hidden_size {arch.hidden_size} but the target has "
                         f"{target.hidden_size}: DFlash runs on the target's embeddings, so they must be equal")
    if cfg.get("is_causal") or "sliding_attention" in (cfg.get("layer_types") or []):
        raise ValueError(f"drafter {source!r}: causal or sliding-window DFlash layers are not supported")
    ids = _dflash_value(cfg, "target_layer_ids")
    if ids is None:
        ids = dflash_default_layer_ids(int(cfg.get("num_target_layers", target.num_layers)), arch.num_layers)
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(f"drafter {source!r}: target_layer_ids {bad} are outside the target's "
                         f"{target.num_layers} layers (they name layer outputs, 0 .. {target.num_layers - 1})")
    mask = _dflash_value(cfg, "mask_token_id")
    if mask is None:
        require_keys({}, {"mask_token_id": "the token that fills the positions the drafter predicts; in "
                          "dflash_config or at the top level"}, _config_file(source))
    if not 0 <= int(mask) < target.vocab_size:
        raise ValueError(f"drafter {source!r}: dflash_config.mask_token_id ({mask}) must be a token of the "
                         f"target's vocabulary [0, {target.vocab_size})")
    block = int(_dflash_value(cfg, "block_size", 16))
    if block < 2:
        raise ValueError(f"drafter {source!r}: block_size ({block}) must be >= 2 (one bonus token and a mask)")
    softcap = _dflash_value(cfg, "final_logit_softcapping")
    return DFlashFormat(arch=arch, block_size=block, mask_token_id=int(mask), feature_layers=tuple(ids),
                        input_embedding_scale=float(_dflash_value(cfg, "input_embedding_scale", 1.0)),
                        output_multiplier=float(_dflash_value(cfg, "output_multiplier", 1.0)),
                        final_logit_softcapping=float(softcap) if softcap else None)


def read_speculators_block(cfg: dict, target: ModelArch, source: str) -> DFlashFormat:
    """DFlash or DSpark in speculators' layout (DSpark: the DFlash backbone plus Markov and
    confidence heads; its defaults differ: sample_from_anchor, both heads on)."""
    is_dspark = detect_format(cfg, source) == DSPARK
    layer_cfg = dict(cfg.get("transformer_layer_config") or {})
    if layer_cfg.get("model_type", "qwen3") != "qwen3":
        raise ValueError(f"drafter {source!r}: speculators' DFlash/DSpark layers are Qwen3 layers, "
                         f"not {layer_cfg.get('model_type')!r}")
    base = read_dflash(dict(layer_cfg, architectures=[DFLASH], block_size=cfg.get("block_size", 8),
                            mask_token_id=cfg.get("mask_token_id"), target_layer_ids=[0]), target, source)
    target_hidden = cfg.get("target_hidden_size") or base.arch.hidden_size
    if target_hidden != target.hidden_size or base.arch.vocab_size != target.vocab_size:
        raise ValueError(f"drafter {source!r} was trained on hidden size {target_hidden} and vocab_size "
                         f"{base.arch.vocab_size}; the target has {target.hidden_size} and {target.vocab_size}")
    entering = cfg.get("aux_hidden_state_layer_ids")
    if not entering:
        raise ValueError(f"drafter {source!r}: aux_hidden_state_layer_ids is required")
    bad = [i for i in entering if not 1 <= i <= target.num_layers]
    if bad:
        raise ValueError(f"drafter {source!r}: aux_hidden_state_layer_ids {bad} (layers entered) must be in "
                         f"[1, {target.num_layers}] for the target's {target.num_layers} layers")
    head_type = cfg.get("markov_head_type", "vanilla")
    if is_dspark and head_type not in ("vanilla", "gated"):
        raise ValueError(f"drafter {source!r}: markov_head_type {head_type!r} is not supported yet "
                         f"(supported: 'vanilla', 'gated')")
    rank = int(cfg.get("markov_rank", 256)) if is_dspark else 0
    has_conf = is_dspark and bool(cfg.get("enable_confidence_head", True))
    return DFlashFormat(arch=base.arch, block_size=base.block_size, mask_token_id=base.mask_token_id,
                        feature_layers=tuple(i - 1 for i in entering),
                        draft_vocab_size=int(cfg.get("draft_vocab_size") or target.vocab_size),
                        sample_from_anchor=bool(cfg.get("sample_from_anchor", is_dspark)), markov_rank=rank,
                        markov_head_type=head_type, has_confidence_head=has_conf,
                        confidence_with_markov=has_conf and bool(cfg.get("confidence_head_with_markov", True)))


def check_tensors(reader, expected: dict[str, tuple[int, ...]], source: str | Path) -> None:
    """Every expected tensor is present with its shape; the error names each one that is not."""
    missing = [name for name in expected if reader.shape(name) is None]
    wrong = [f"{name} {list(reader.shape(name))} (expected {list(shape)})" for name, shape in expected.items()
             if name not in missing and reader.shape(name) != tuple(shape)]
    if missing or wrong:
        parts = ([f"missing {missing}"] if missing else []) + ([f"mis-shaped {wrong}"] if wrong else [])
        raise ValueError(f"drafter checkpoint {str(source)!r}: " + "; ".join(parts))


def layer_tensors(prefix: str, arch: ModelArch, attn_in: int) -> dict[str, tuple[int, ...]]:
    """The decoder layer's tensors in Hugging Face names (q/k/v read ``attn_in`` features)."""
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    out = {f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.post_attention_layernorm.weight": (h,),
           f"{prefix}.self_attn.q_proj.weight": (arch.num_heads * hd, attn_in),
           f"{prefix}.self_attn.k_proj.weight": (arch.num_kv_heads * hd, attn_in),
           f"{prefix}.self_attn.v_proj.weight": (arch.num_kv_heads * hd, attn_in),
           f"{prefix}.self_attn.o_proj.weight": (h, arch.num_heads * hd),
           f"{prefix}.mlp.gate_proj.weight": (inter, h), f"{prefix}.mlp.up_proj.weight": (inter, h),
           f"{prefix}.mlp.down_proj.weight": (h, inter)}
    if arch.family.has_qk_norm:
        out.update({f"{prefix}.self_attn.q_norm.weight": (hd,), f"{prefix}.self_attn.k_norm.weight": (hd,)})
    return out
