"""Drafters for speculative decoding (built per rank, sharded like the target).

| method        | kind       | KV                         | drafts per forward | module            |
|---------------|------------|----------------------------|--------------------|-------------------|
| ``draft_model`` | standalone | own pool, 32/64-token pages | 1 (autoregressive) | draft_model.py    |
| ``dflash``      | standalone | own pool, 32/64-token pages | k (one block)      | dflash.py         |
| ``dspark``      | standalone | own pool, 32/64-token pages | k (one block)      | dspark.py         |
| ``eagle3``      | one-model  | last layer of target pool  | 1 (autoregressive) | eagle3.py         |
| ``mtp``         | one-model  | last layer(s) of target pool | 1 (autoregressive) | mtp.py          |
| ``ngram``       | pool-less  | none                       | 0..k (lookup)      | ngram.py          |

``SpecConfig.draft_model`` names the drafter's checkpoint directory or preset; None picks
the preset matching a preset target (``<target>-draft``, ``-dflash``, ``-dspark``, ``-eagle3``).
``mtp`` reads the MTP modules inside the target checkpoint itself (mtp_format.py;
draft_model may name a copy of the target that has them, such as the ``<target>-mtp``
presets). ``eagle3``, ``dflash`` and ``dspark`` read the published formats (published.py
loads them; formats.py detects which from config.json and documents the aux-layer convention).
``ngram`` has no checkpoint: it drafts from each sequence's own tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specray.comm.context import DistContext
from specray.config import EngineConfig
from specray.models.arch import ModelArch
from specray.models.presets import drafter_preset_name, is_preset, resolve_model


def drafter_checkpoint(config: EngineConfig) -> Path:
    """The drafter's checkpoint directory: the configured one, or the target preset's match."""
    spec = config.spec
    if spec.draft_model is not None:
        return resolve_model(spec.draft_model, config.seed)
    if not is_preset(config.model):
        raise ValueError(f"spec method {spec.method!r} with target checkpoint {config.model!r} needs "
                         f"spec.draft_model (--draft-model): only preset targets have a built-in drafter")
    return resolve_model(drafter_preset_name(config.model, spec.method), config.seed)


def _checkpoint_of(config: EngineConfig) -> Path:
    """The checkpoint a drafter of ``config`` reads (not for ``ngram``, which reads none)."""
    spec = config.spec
    if spec.method == "mtp":  # the target's own checkpoint, unless draft_model names a copy with MTP weights
        from specray.models.drafters.mtp import mtp_checkpoint

        draft = None if spec.draft_model is None else resolve_model(spec.draft_model, config.seed)
        return mtp_checkpoint(resolve_model(config.model, config.seed), draft)
    return drafter_checkpoint(config)


def check_drafter(config: EngineConfig, target: ModelArch) -> None:
    """Check the drafter of ``config`` against the target without loading a weight: its
    format, and what must fit the target (hidden size, vocabulary, aux layers, draft length;
    for MTP every tensor's name and shape, from the checkpoint's header). The driver runs it
    before any rank starts, so a bad drafter fails in a moment rather than after every rank
    has loaded the target; the ranks check the same again as they load, plus every tensor."""
    spec = config.spec
    if spec.method in (None, "ngram"):
        return
    path = _checkpoint_of(config)
    if spec.method == "draft_model":
        from specray.models.drafters.draft_model import check_vocabulary

        check_vocabulary(path, target)
    elif spec.method == "mtp":
        from specray.models.drafters.mtp import read_mtp
        from specray.models.loader import CheckpointReader

        reader = CheckpointReader(path, torch.float32, torch.device("cpu"))
        try:
            read_mtp(path, target, reader)
        finally:
            reader.close()
    else:
        from specray.models.drafters.published import read_published_format

        read_published_format(spec.method, path, target, spec.num_draft_tokens, spec.dspark_confidence_threshold)


def build_drafter(config: EngineConfig, ctx: DistContext, target):
    """The drafter for ``config.spec.method`` on this rank, or None for plain decoding."""
    spec = config.spec
    if spec.method is None:
        return None
    if spec.method == "ngram":  # no checkpoint to find: the factory is the one place that knows
        from specray.models.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.prompt_lookup_spec_factor)
    path = _checkpoint_of(config)
    if spec.method == "draft_model":
        from specray.models.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.load(path, ctx, config.dtype, target)
    if spec.method in ("eagle3", "dflash", "dspark"):
        from specray.models.drafters.published import load_published_drafter

        return load_published_drafter(spec.method, path, spec.num_draft_tokens, ctx, config.dtype, target,
                                      spec.dspark_confidence_threshold)
    from specray.models.drafters.mtp import load_mtp_drafter

    return load_mtp_drafter(path, spec.num_draft_tokens, ctx, config.dtype, target)
