"""Drafters for speculative decoding (built per rank, sharded like the target).

| method        | kind       | KV                         | drafts per forward | module            |
|---------------|------------|----------------------------|--------------------|-------------------|
| ``draft_model`` | standalone | own pool, 32/64-token pages | 1 (autoregressive) | draft_model.py    |
| ``dflash``      | standalone | own pool, 32/64-token pages | k (one block)      | dflash.py         |
| ``dspark``      | standalone | own pool, 32/64-token pages | k (one block)      | dspark.py         |
| ``eagle3``      | one-model  | last layer of target pool  | 1 (autoregressive) | eagle3.py         |
| ``mtp``         | one-model  | last layer of target pool  | 1 (autoregressive) | hidden_state.py   |
| ``ngram``       | pool-less  | none                       | 0..k (lookup)      | ngram.py          |

``SpecConfig.draft_model`` names the drafter's checkpoint directory or preset; None picks
the preset matching a preset target (``<target>-draft``, ``-dflash``, ``-dspark``, ``-eagle3``,
``-mtp``). ``eagle3``, ``dflash`` and ``dspark`` read the published formats (published.py loads
them; formats.py detects which from config.json and documents the aux-layer convention).
``ngram`` has no checkpoint: it drafts from each sequence's own tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specray.comm.context import DistContext
from specray.config import EngineConfig
from specray.errors import require_keys
from specray.models.arch import arch_from_hf_config
from specray.models.loader import CheckpointReader
from specray.models.drafter_presets import HEAD_ARCHITECTURES
from specray.models.presets import drafter_preset_name, is_preset, resolve_model

# The keys each head's config.json must have beyond the layer sizes, and what each is for.
HEAD_KEYS = {"mtp": {}}


def drafter_checkpoint(config: EngineConfig) -> Path:
    """The drafter's checkpoint directory: the configured one, or the target preset's match."""
    spec = config.spec
    if spec.draft_model is not None:
        return resolve_model(spec.draft_model, config.seed)
    if not is_preset(config.model):
        raise ValueError(f"spec method {spec.method!r} with target checkpoint {config.model!r} needs "
                         f"spec.draft_model (--draft-model): only preset targets have a built-in drafter")
    return resolve_model(drafter_preset_name(config.model, spec.method), config.seed)


def _head_arch(cfg: dict, path: Path, method: str, target):
    want = HEAD_ARCHITECTURES[method]
    if cfg.get("architectures") != [want]:
        raise ValueError(f"drafter checkpoint {str(path)!r} has architectures {cfg.get('architectures')}, "
                         f"but spec method {method!r} needs [{want!r}]")
    source = f"{method} drafter config {str(path / 'config.json')!r}"
    require_keys(cfg, HEAD_KEYS[method], source)
    arch = arch_from_hf_config(dict(cfg, architectures=["LlamaForCausalLM"]), source=source)
    t = target.arch
    if arch.vocab_size != t.vocab_size or arch.hidden_size != t.hidden_size:
        raise ValueError(f"drafter {str(path)!r} has vocab_size {arch.vocab_size}, hidden_size {arch.hidden_size}; "
                         f"the target has {t.vocab_size}, {t.hidden_size}: they must be equal")
    bad = [i for i in cfg.get("target_layer_ids", []) if not 0 <= i < t.num_layers]
    if bad:
        raise ValueError(f"drafter {str(path)!r}: target_layer_ids {bad} are outside the target's "
                         f"{t.num_layers} layers")
    return arch


def build_drafter(config: EngineConfig, ctx: DistContext, target):
    """The drafter for ``config.spec.method`` on this rank, or None for plain decoding."""
    spec = config.spec
    if spec.method is None:
        return None
    if spec.method == "ngram":  # no checkpoint to find: the factory is the one place that knows
        from specray.models.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    path = drafter_checkpoint(config)
    if spec.method == "draft_model":
        from specray.models.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.load(path, ctx, config.dtype, target)
    if spec.method in ("eagle3", "dflash", "dspark"):
        from specray.models.drafters.published import load_published_drafter

        return load_published_drafter(spec.method, path, spec.num_draft_tokens, ctx, config.dtype, target)
    cfg = json.loads((path / "config.json").read_text())
    arch = _head_arch(cfg, path, spec.method, target)
    dtype = getattr(torch, config.dtype)
    from specray.models.drafters.common import FINAL_HIDDEN
    from specray.models.drafters.hidden_state import HiddenStateDrafter

    drafter = HiddenStateDrafter(arch, target, ctx, dtype, (FINAL_HIDDEN,))
    reader = CheckpointReader(path, dtype, ctx.device)
    drafter.load(reader)
    reader.close()
    return drafter.eval()
