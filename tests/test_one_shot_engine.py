"""The one-shot all-reduce inside the engine: DistContext gives each tensor group the reducer
selection allows (node membership faked), and greedy decoding with it gives the same tokens as
with torch.distributed at TP=2 and on the MoE mappings."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams
from specray.comm.allreduce import SelectedAllReduce
from specray.comm.context import DistContext
from specray.comm.rendezvous import Rendezvous
from specray.comm.shm import leftover_segments
from test_one_shot import results_by_rank, spawn_ranks  # tests/ is on sys.path (no __init__.py)

GROUPS = ("tp", "moe_tp", "moe_ep")


def _context_phase(rank: int, store_path: str, node_keys: str, mode: str) -> dict:
    """Build a 4-rank DistContext (moe_tp 2 x moe_ep 2) on the given fake hosts; reduce on each group."""
    rdzv = Rendezvous(rank=rank, world_size=4, local_rank=rank, local_world_size=4, node_key=node_keys[rank])
    parallel = ParallelConfig(tp_size=4, moe_tp_size=2, moe_ep_size=2, allreduce=mode, timeout_s=30.0)
    ctx = DistContext.create(rdzv, parallel, "cpu", dist.FileStore(store_path, 4))
    seen = {}
    for name in GROUPS:
        group = getattr(ctx, name)
        x = group.all_reduce(torch.full((3, 4), float(rank + 1)))
        expected = float(sum(r + 1 for r in group.ranks))
        assert torch.equal(x, torch.full((3, 4), expected)), f"{name} over {group.ranks}: {x}"
        reducer = group.reducer
        seen[name] = None if reducer is None else dict(
            kind=type(reducer).__name__, calls=reducer.one_shot.num_calls, path=reducer.one_shot.path)
    job_id = ctx.job_id
    ctx.close()
    return dict(groups=seen, job_id=job_id, leftover=leftover_segments(job_id))


def _context_body(rank: int, world: int, store_path: str, queue) -> list[dict]:
    # two fake hosts "a" (ranks 0, 1) and "b" (ranks 2, 3); then one host with one_shot and torch
    return [_context_phase(rank, f"{store_path}.{i}", keys, mode)
            for i, (keys, mode) in enumerate([("aabb", "auto"), ("aaaa", "one_shot"), ("aaaa", "torch")])]


def test_context_attaches_one_shot_within_a_node_and_hierarchical_across_nodes(tmp_path):
    results = results_by_rank(*spawn_ranks(4, _context_body, tmp_path))
    for rank, (two_hosts, one_host, torch_mode) in results.items():
        # moe_tp groups (0,1), (2,3) sit on one host each: one-shot; tp spans both hosts 2 + 2:
        # hierarchical (a one-shot segment per host); moe_ep (0,2), (1,3) has one rank per host: torch
        assert two_hosts["groups"]["moe_ep"] is None
        for name in ("moe_tp", "tp"):
            reducer = two_hosts["groups"][name]
            assert reducer["kind"] == SelectedAllReduce.__name__ and reducer["calls"] == 1
            assert f"specray-{two_hosts['job_id']}-ar-" in reducer["path"], "segment names carry the job id"
        assert all(one_host["groups"][name]["calls"] == 1 for name in GROUPS)
        assert torch_mode["groups"] == {name: None for name in GROUPS}
        assert two_hosts["leftover"] == one_host["leftover"] == []


# ---------------------------------------------------------------- greedy decoding parity

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41], [300, 9, 27, 1, 77]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _tokens(model, tp: int, moe_tp: int | None, moe_ep: int | None, mode: str) -> list[list[int]]:
    parallel = ParallelConfig(tp_size=tp, moe_tp_size=moe_tp, moe_ep_size=moe_ep, launcher="mp",
                              allreduce=mode, timeout_s=60.0)
    config = EngineConfig(model=str(model), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024),
                          parallel=parallel)
    with LLM(config) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("family, tp, moe_tp, moe_ep", [
    ("llama", 2, None, None),
    ("qwen3_moe", 2, 1, 2),  # whole experts split over two ranks: the combine sums disjoint experts
    ("qwen3_moe", 4, 2, 2),  # experts split both ways
])
def test_greedy_tokens_with_one_shot_equal_torch(tiny_checkpoints, family, tp, moe_tp, moe_ep):
    """Exact equality: tiny random models have no near-ties in 6 tokens, so a wrong sum (or a
    rank that summed differently) would change a token; a tolerance would hide it."""
    model = tiny_checkpoints(family)
    one_shot = _tokens(model, tp, moe_tp, moe_ep, "one_shot")
    assert one_shot == _tokens(model, tp, moe_tp, moe_ep, "torch")
    assert all(len(t) == GREEDY.max_tokens for t in one_shot)
