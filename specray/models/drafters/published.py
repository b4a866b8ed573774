"""The one loader for drafters in published formats: detect the format from ``config.json``,
check it against the spec method and the target, build the drafter and load its tensors
(which are checked by name and shape first)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specray.comm.context import DistContext
from specray.models.decoder import CausalLM
from specray.models.arch import ModelArch
from specray.models.drafters.formats import (
    DFLASH,
    FORMAT_METHODS,
    DFlashFormat,
    Eagle3Format,
    detect_format,
    read_dflash,
    read_eagle3,
    read_speculators_block,
)
from specray.models.loader import CheckpointReader


def read_config(path: Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"drafter checkpoint {str(path)!r} has no config.json")
    return json.loads(file.read_text())


def read_published_format(method: str, path: Path, target: ModelArch, num_draft_tokens: int,
                          confidence_threshold: float | None = None) -> tuple[str, Eagle3Format | DFlashFormat]:
    """(format name, architecture) of the ``eagle3``, ``dflash`` or ``dspark`` checkpoint at
    ``path``, checked against the spec method and the target from ``config.json`` alone: no
    tensor is read, so the driver runs it before any rank starts (and every rank again)."""
    cfg, source = read_config(path), str(path)
    found = detect_format(cfg, source)
    if FORMAT_METHODS[found] != method:
        wanted = sorted(name for name, m in FORMAT_METHODS.items() if m == method)
        raise ValueError(f"drafter {source!r} is a {found} checkpoint (a {FORMAT_METHODS[found]} drafter), "
                         f"but spec method {method!r} needs one of {wanted}")
    if method == "eagle3":
        return found, read_eagle3(cfg, target, source)
    fmt = (read_dflash if found == DFLASH else read_speculators_block)(cfg, target, source)
    if num_draft_tokens > fmt.max_drafts:
        anchor = "block_size" if fmt.sample_from_anchor else "block_size - 1"
        raise ValueError(f"num_draft_tokens ({num_draft_tokens}) must be <= {anchor} ({fmt.max_drafts}) "
                         f"of {method} drafter {source!r}")
    if confidence_threshold is not None and not fmt.has_confidence_head:
        raise ValueError(f"dspark_confidence_threshold ({confidence_threshold}) needs a confidence head, "
                         f"and drafter {source!r} has none (enable_confidence_head is false)")
    return found, fmt


def load_published_drafter(method: str, path: Path, num_draft_tokens: int, ctx: DistContext, dtype: str,
                           target: CausalLM, confidence_threshold: float | None = None):
    """The ``eagle3``, ``dflash`` or ``dspark`` drafter of checkpoint ``path`` on this rank
    (``confidence_threshold``: dspark's early stop, see dspark.py)."""
    found, fmt = read_published_format(method, path, target.arch, num_draft_tokens, confidence_threshold)
    torch_dtype = getattr(torch, dtype)
    reader = CheckpointReader(path, torch_dtype, ctx.device)
    try:
        if method in ("dflash", "dspark"):
            from specray.models.drafters.dflash import DFlashDrafter
            from specray.models.drafters.dspark import DSparkDrafter

            # speculators' layouts may carry a draft vocabulary and heads: DSparkDrafter reads them all
            drafter = (DFlashDrafter if found == DFLASH else DSparkDrafter)(fmt, target, ctx, torch_dtype)
            if confidence_threshold is not None:
                drafter.confidence_threshold = confidence_threshold
        else:
            from specray.models.drafters.eagle3 import Eagle3Drafter

            drafter = Eagle3Drafter(fmt, target, ctx, torch_dtype, has_embed=reader.has("embed_tokens.weight"))
        drafter.load(reader)
    finally:
        reader.close()
    return drafter.eval()
