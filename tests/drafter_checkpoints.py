"""Tiny drafter checkpoints in the published formats (seeded random weights, written by
drafter_presets) for a target checkpoint directory or GGUF file, and helpers that drive a
drafter directly, for test_drafter_formats*.py and test_spec_smollm2.py."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from specray.comm.context import DistContext
from specray.models.drafter_presets import dflash_config, dspark_config, eagle3_config, head_weights
from specray.models.drafters.common import DraftBatch, DraftSeq
from specray.models.drafters.published import load_published_drafter
from specray.models.checkpoint_writer import write_checkpoint
from specray.models.loader import read_model_arch

PAGE = 32


def speculators_module(name: str):
    """A module of the installed ``speculators`` without running its package ``__init__``."""
    if "speculators" in sys.modules:
        root = Path(sys.modules["speculators"].__path__[0])
    else:
        spec = importlib.util.find_spec("speculators")
        if spec is None:
            pytest.fail("speculators is not installed: `make venv` installs TEST_REFERENCES")
        root = Path(spec.submodule_search_locations[0])
    for pkg in ("speculators", "speculators.models", "speculators.models.eagle3", "speculators.models.dflash",
                "speculators.models.dspark", "speculators.models.mtp"):
        if pkg not in sys.modules:
            module = types.ModuleType(pkg)
            module.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]
            sys.modules[pkg] = module
    return importlib.import_module(name)


def write_eagle3(directory: Path, target_dir: Path, layout="specforge", draft_vocab=None, embed=False,
                 seed=1, **overrides) -> Path:
    cfg = dict(eagle3_config(read_model_arch(target_dir), layout, draft_vocab), **overrides)
    write_checkpoint(directory, cfg, head_weights("eagle3", cfg, seed, with_embed=embed))
    return directory


def write_dflash(directory: Path, target_dir: Path, seed=1, **overrides) -> Path:
    cfg = dict(dflash_config(read_model_arch(target_dir)), **overrides)
    write_checkpoint(directory, cfg, head_weights("dflash", cfg, seed))
    return directory


def write_dspark(directory: Path, target_dir: Path, seed=1, **options) -> Path:
    cfg = dspark_config(read_model_arch(target_dir), **options)
    write_checkpoint(directory, cfg, head_weights("dspark", cfg, seed))
    return directory


WRITERS = {"eagle3": write_eagle3, "dflash": write_dflash, "dspark": write_dspark}


def load(method, path, target_model, k=3):
    return load_published_drafter(method, path, k, DistContext.single(), "float32", target_model)


def propose(drafter, tokens, features, k, pools, consumed=0):
    """specray's drafts [k] and their target-vocabulary logits [k, V] for one sequence."""
    logits = []

    def choose(row_logits, j):
        logits.append(row_logits[0].clone())
        return row_logits.argmax(-1)

    table = list(range(pools[0].shape[0]))
    batch = DraftBatch([DraftSeq(list(tokens), consumed, features, table)], k, pools, PAGE, torch.device("cpu"))
    return drafter.propose(batch, choose)[0].tolist(), torch.stack(logits)


def empty_pools(drafter, num_layers):
    layout = drafter.kv_layout
    return [torch.zeros(8, 2, layout.num_kv_heads, PAGE, layout.head_dim) for _ in range(num_layers)]


def target_features(target_model, hf_target, tokens, layers):
    """The target's outputs of ``layers`` at every position but the last (transformers' run)."""
    with torch.no_grad():
        hidden = hf_target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0, :-1] for i in layers], dim=-1)  # hidden_states[0] is the embedding
