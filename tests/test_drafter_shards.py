"""Drafters sharded over two tensor-parallel ranks propose what the unsharded drafter proposes.

The ranks are two threads of this process whose all-reduce and all-gather meet at a barrier
(``ThreadRanks``): every layer loads and runs its own shard exactly as on a rank process, so a
wrong shard or a missing collective in a drafter's fast path shows in its drafts and logits.
The engine's TP 2 tests cannot see that: a bad drafter keeps the output lossless and only
lowers acceptance, and a random drafter accepts almost nothing either way.

Reference: the same checkpoint on one rank. Tolerance: TOL (float32; the shards' partial sums
are added in another order than the unsharded GEMM's).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from checkpoints import load_reference, make_checkpoint
from drafter_checkpoints import WRITERS, empty_pools, propose, target_features

from specray.comm.context import DistContext
from specray.comm.group import Group
from specray.models.drafter_presets import write_drafter_for
from specray.models.drafters.mtp import load_mtp_drafter
from specray.models.drafters.published import load_published_drafter
from specray.workers.worker import load_model

TOL = dict(rtol=1e-4, atol=1e-5)
TOKENS = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45, 200, 13, 14]


class ThreadRanks:
    """``size`` tensor-parallel ranks as threads: each collective is an exchange at a barrier."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody writes the next exchange's slot before every rank has read this one's
        return parts

    def run(self, fn) -> list:
        """``fn(ctx)`` on every rank, each with its own tp group; their results in rank order."""
        results, errors = [None] * self.size, []

        def rank_main(rank: int) -> None:
            try:
                results[rank] = fn(dataclasses.replace(DistContext.single(), tp=_ThreadGroup(self, rank)))
            except BaseException as e:  # noqa: BLE001 (reported below, and the other ranks released)
                errors.append(e)
                self.barrier.abort()
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"rank threads still running after 120 s: {[t.name for t in threads if t.is_alive()]}")
        if errors:  # the failing rank's error, not the broken barrier it left the others
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return results


class _ThreadGroup(Group):
    def __init__(self, ranks: ThreadRanks, rank: int):
        self._shared, self.ranks, self.rank_in_group = ranks, tuple(range(ranks.size)), rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._shared.exchange(self.rank_in_group, x)
        return torch.stack(parts).sum(0)  # the same order on every rank, so they agree to the bit

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._shared.exchange(self.rank_in_group, x), dim=dim)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_checkpoint("llama", tmp_path_factory.mktemp("shards") / "target", seed=3, num_hidden_layers=4)
    return path, load_reference(path)


def _two_steps(drafter, tokens, features, k, split):
    """Drafts and logits of a first step over tokens[:split + 1], then of the rest."""
    pools = empty_pools(drafter, drafter.kv_layout.num_layers)
    first = propose(drafter, tokens[:split + 1], features[:split], k, pools)
    return first, propose(drafter, tokens, features[split:], k, pools, consumed=split)


def _loader(method, path, target_dir, k):
    """The target and its drafter loaded on a rank of ``ctx``: ctx -> drafter."""
    def build(ctx):
        model = load_model(target_dir, ctx, "float32")
        if method == "mtp":
            return load_mtp_drafter(path, k, ctx, "float32", model)
        return load_published_drafter(method, path, k, ctx, "float32", model)
    return build


@pytest.mark.parametrize("method", ["eagle3", "mtp", "dflash", "dspark"])
def test_two_ranks_propose_the_unsharded_drafts(target, tmp_path, method):
    target_dir, hf = target
    if method == "mtp":  # the target's own MTP modules: a dense block (fused_layer.c's blocks)
        path = write_drafter_for(target_dir, "mtp", tmp_path / "d", seed=1, num_modules=2, layout="deepseek_v3")
    else:
        path = WRITERS[method](tmp_path / "d", target_dir)
    k = 4
    build = _loader(method, path, target_dir, k)
    one = build(DistContext.single())
    if method == "mtp":
        with torch.no_grad():
            features = hf.model(torch.tensor([TOKENS])).last_hidden_state[0, :-1]  # after the final norm
    else:
        features = target_features(one.target[0], hf, TOKENS, one.feature_layers)
    expected = _two_steps(one, TOKENS, features, k, 17)
    ranks = ThreadRanks(2).run(lambda ctx: _two_steps(build(ctx), TOKENS, features, k, 17))
    for rank in ranks:
        for (drafts, logits), (want_drafts, want_logits) in zip(rank, expected, strict=True):
            assert drafts == want_drafts
            torch.testing.assert_close(logits, want_logits, **TOL)
    for (_, a), (_, b) in zip(*ranks, strict=True):
        assert torch.equal(a, b)  # the ranks agree to the bit
