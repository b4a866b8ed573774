"""RankWorker: one rank's device, model shards, KV pools and step execution.

Every rank runs the same ``execute`` on the same plan. A worker mirrors, per sequence, the
block table and the sampling state; the plan only carries what changed.
"""

from __future__ import annotations

import logging

import torch

from specray.comm.context import DistContext
from specray.config import EngineConfig, SamplingParams
from specray.executor.plan import StepPlan
from specray.executor.sampling import sample
from specray.kv.budget import kv_budget_bytes, pool_geometry
from specray.kv.geometry import PoolGeometry, allocate_pool
from specray.models.arch import ModelArch, read_arch
from specray.models.attention import AttentionMetadata
from specray.models.decoder import CausalLM
from specray.models.loader import CheckpointReader
from specray.models.presets import resolve_model
from specray.workers.token_check import check_same_on_every_rank, fold

log = logging.getLogger(__name__)


def load_model(path, ctx: DistContext, dtype: str) -> CausalLM:
    arch = read_arch(path)
    torch_dtype = getattr(torch, dtype)
    model = CausalLM(arch, ctx, torch_dtype)
    reader = CheckpointReader(path, torch_dtype, ctx.device)
    model.load(reader)
    reader.close()
    return model.eval()


class RankWorker:
    def __init__(self, config: EngineConfig, ctx: DistContext):
        self.config, self.ctx = config, ctx
        torch.manual_seed(config.seed)
        self.model = load_model(resolve_model(config.model, config.seed), ctx, config.dtype)
        self.pools: list[torch.Tensor] = []
        self.geometry: dict[str, PoolGeometry] = {}
        self.block_tables: dict[int, list[int]] = {}
        self.samplers: dict[int, tuple[SamplingParams, torch.Generator]] = {}
        self.num_steps = 0
        self.token_digest = 0  # crc32 of every token this rank sampled (see token_check.py)

    @property
    def arch(self) -> ModelArch:
        return self.model.arch

    def init_pools(self) -> dict[str, PoolGeometry]:
        """Agree the pool geometry with every rank and allocate exactly that (collective)."""
        cfg, arch = self.config, self.arch
        target = pool_geometry(
            tokens_per_block=cfg.kv.tokens_per_block, capacity_tokens=cfg.kv.capacity_tokens,
            budget_bytes=kv_budget_bytes(cfg.kv, self.ctx.device), num_layers=arch.num_layers,
            num_kv_heads=self.model.num_local_kv_heads, head_dim=arch.head_dim, dtype=cfg.dtype,
        )
        self.geometry = {"target": target}
        self.pools = allocate_pool(target, self.ctx.device)
        return self.geometry

    def _apply_deltas(self, plan: StepPlan) -> None:
        for sid in plan.finished:
            self.block_tables.pop(sid, None)
            self.samplers.pop(sid, None)
        for sid in plan.preempted:
            self.block_tables[sid] = []
        for sid, (params, seed) in plan.new_seqs.items():
            gen = torch.Generator(device=self.ctx.device).manual_seed(seed)
            self.samplers[sid] = (params, gen)
        for sid, blocks in zip(plan.seq_ids, plan.new_blocks):
            self.block_tables.setdefault(sid, []).extend(blocks)

    def _metadata(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev, block_size = self.ctx.device, self.geometry["target"].tokens_per_block
        tables = [self.block_tables[sid] for sid in plan.seq_ids]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=dev)
        query_lens = [len(ids) for ids in plan.input_ids]
        ids = torch.tensor([t for seq in plan.input_ids for t in seq], dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(plan.start_positions, query_lens)]).to(dev)
        rows = torch.repeat_interleave(torch.arange(len(tables), device=dev),
                                       torch.tensor(query_lens, device=dev))
        slots = block_tables[rows, positions // block_size] * block_size + positions % block_size
        context_lens = torch.tensor([p + n for p, n in zip(plan.start_positions, query_lens)], device=dev)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables,
                                 context_lens=context_lens, query_lens=query_lens)
        return ids, positions, meta

    def execute(self, plan: StepPlan) -> list[int]:
        """Run one step; returns the sampled token of every scheduled sequence.

        Every rank runs this on the same plan and must sample the same tokens: checked per
        step in ``check_every_step`` mode, and by a digest at the end of each call."""
        tokens = self._forward_and_sample(plan)
        if tokens:
            self.num_steps += 1
            self.token_digest = fold(self.token_digest, tokens)
            if self.config.parallel.check_every_step:
                check_same_on_every_rank(self.ctx.cpu, (plan.seq_ids, tokens), f"step {self.num_steps} tokens")
        if plan.is_call_end:
            check_same_on_every_rank(self.ctx.cpu, (self.num_steps, self.token_digest),
                                     "(steps, token digest) at the end of the generate call")
        return tokens

    @torch.inference_mode()
    def _forward_and_sample(self, plan: StepPlan) -> list[int]:
        self._apply_deltas(plan)
        if not plan.seq_ids:
            return []
        ids, positions, meta = self._metadata(plan)
        hidden = self.model(ids, positions, self.pools, meta)
        last = torch.tensor(meta.query_lens, device=hidden.device).cumsum(0) - 1
        logits = self.model.logits(hidden[last])
        tokens = []
        for row, sid in zip(logits, plan.seq_ids):
            params, gen = self.samplers[sid]
            tokens.append(sample(row, params, gen))
        return tokens
