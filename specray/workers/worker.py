"""RankWorker: one rank's device, model shards, KV pools and step execution.

Every rank runs the same ``execute`` on the same plan. A worker mirrors, per sequence, the
block table and the sampling state; the plan only carries what changed.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from pathlib import Path

import torch

from specray.comm.context import DistContext
from specray.config import EngineConfig, SamplingParams
from specray.envs import rank_page_sizes, rank_value
from specray.kv.agreement import RankReport, agree, verify
from specray.kv.budget import rank_kv_budget_bytes
from specray.kv.geometry import PoolGeometry, allocate_pool
from specray.kv.state import StateGeometry, allocate_state_pool, num_state_slots
from specray.models.arch import ModelArch
from specray.models.attention import build_metadata
from specray.models.block_attention import BLOCK_DECODE_PAGE_SIZES
from specray.models.drafters import build_drafter
from specray.models.drafters.common import last_rows
from specray.models.linear_state import commit_accepted
from specray.models.loader import load_model
from specray.models.mla import mla_kernel_rule
from specray.models.presets import is_preset, resolve_model
from specray.models.tokenizer import load_tokenizer
from specray.workers.barrier_waits import BarrierWaits
from specray.workers.cpu_malloc import release_cpu_malloc, tune_cpu_malloc
from specray.workers.grammar import Grammars
from specray.workers.logprobs import TokenLogprob, compute_prompt_logprobs, rows_logprobs
from specray.workers.plan import StepPlan
from specray.workers.sampling import sample_rows
from specray.workers.spec_step import SpecRunner
from specray.workers.token_check import check_same_on_every_rank, fold

log = logging.getLogger(__name__)


def spread(values: list, rows: list[int], n: int) -> list:
    """A list of ``n`` with ``values[j]`` at index ``rows[j]`` and None elsewhere."""
    out: list = [None] * n
    for row, value in zip(rows, values):
        out[row] = value
    return out


class RankWorker:
    def __init__(self, config: EngineConfig, ctx: DistContext):
        self.config, self.ctx = config, ctx
        if ctx.device.type == "cpu":
            tune_cpu_malloc()
        torch.manual_seed(config.seed)
        self.model = load_model(resolve_model(config.model, config.seed), ctx, config.dtype)
        self.drafter = build_drafter(config, ctx, self.model)
        self.pools: list = []  # target pool, per layer its pages (a tensor) or, linear layers, its LayerState
        self.draft_pools: list[torch.Tensor] = []  # standalone drafter's pool
        self.geometry: dict[str, PoolGeometry | StateGeometry] = {}
        self.block_tables: dict[int, list[int]] = {}
        self.state_rows: dict[int, int] = {}  # hybrid targets: each sequence's committed state row
        self.samplers: dict[int, tuple[SamplingParams, torch.Generator]] = {}
        self.grammars = Grammars(self._tokenizer, self.arch.vocab_size, self.arch.eos_token_ids)
        self.spec = SpecRunner(self) if self.drafter is not None else None  # speculative steps
        self.step_logprobs: list[list[TokenLogprob] | None] | None = None  # per row of the last step
        self.step_prompt_logprobs: dict[int, list[TokenLogprob]] = {}  # per sequence of the last step
        self.num_steps = 0
        self.token_digest = 0  # crc32 of every token this rank sampled (see token_check.py)
        self.table_digest = 0  # crc32 of the block tables of every step's rows (prefix hits share pages)
        step_dir = os.environ.get("SPECRAY_TEST_STEP_DIR")  # testing only: see envs.py
        self._step_file = Path(step_dir) / f"rank{ctx.rank}.steps" if step_dir else None
        self.barrier_waits = BarrierWaits.for_device(ctx.device)  # spin or sleep at OpenMP barriers

    @property
    def arch(self) -> ModelArch:
        return self.model.arch

    def release(self) -> None:
        """Drop the weights, the drafter and the pools now (the local launcher's close, where
        the process lives on): reference cycles through this rank's state would otherwise keep
        them, gigabytes of KV among them, until the garbage collector's next full pass."""
        self.pools, self.draft_pools = [], []
        self.model = self.drafter = self.spec = None
        if self.ctx.device.type == "cpu":
            release_cpu_malloc()  # what the tuned malloc kept of them (workers/cpu_malloc.py)

    def _tokenizer(self):
        """The model's tokenizer (for grammars), or None when it has none."""
        try:
            return load_tokenizer(resolve_model(self.config.model, self.config.seed),
                                  is_byte_level=is_preset(self.config.model))
        except ValueError:
            return None

    def init_pools(self) -> dict[str, PoolGeometry]:
        """Agree the pool geometry with every rank and allocate exactly that (collective)."""
        cfg, ctx = self.config, self.ctx
        # hybrid targets: a committed state row and one per draft position for every sequence (kv/state.py)
        num_rows = num_state_slots(cfg.max_num_seqs, cfg.spec.num_draft_tokens if cfg.spec.is_enabled else 0)
        geometry = agree(ctx.cpu, self.report(), cfg.kv, cfg.spec.method, cfg.dtype, num_state_slots=num_rows)
        extra = int(rank_value("SPECRAY_FAULT_KV_EXTRA_BLOCKS", ctx.rank) or 0)  # testing only
        if extra:
            geometry["target"] = replace(geometry["target"], num_blocks=geometry["target"].num_blocks + extra)
        extra = int(rank_value("SPECRAY_FAULT_STATE_EXTRA_SLOTS", ctx.rank) or 0)  # testing only
        if extra:
            geometry["state"] = replace(geometry["state"], num_slots=geometry["state"].num_slots + extra)
        pools = {name: allocate_state_pool(g, ctx.device) if isinstance(g, StateGeometry)
                 else allocate_pool(g, ctx.device) for name, g in geometry.items()}
        verify(ctx.cpu, pools)
        self.geometry = geometry
        self.pools = self.model.layer_pools(pools["target"], pools.get("state"))  # per layer: pages or state
        self.draft_pools = pools.get("draft", [])
        return geometry

    def report(self) -> RankReport:
        """What this rank tells rank 0: its KV budget, kernels' page sizes and KV layouts."""
        cfg, ctx, arch = self.config, self.ctx, self.arch
        fraction = float(rank_value("SPECRAY_KV_MEMORY_FRACTION", ctx.rank) or cfg.kv.memory_fraction)
        layout = self.model.kv_layout  # kind kv (K and V per kv head) or latent (MLA: one row per token)
        draft_layout, draft_kernels = None, {}
        if self.drafter is not None and self.drafter.is_standalone:
            draft_layout = self.drafter.kv_layout
            narrowed = rank_page_sizes("SPECRAY_DRAFT_KERNEL_PAGE_SIZES", ctx.rank)
            sizes = BLOCK_DECODE_PAGE_SIZES if narrowed is None else BLOCK_DECODE_PAGE_SIZES & narrowed
            draft_kernels = {"block_decode_attention": sizes}
        elif self.drafter is not None and self.drafter.kv_layout is not None:
            # one-model drafter: its layers live in the target pool (a pool-less one adds nothing)
            own = self.drafter.kv_layout
            if (own.kind, own.num_kv_heads, own.head_dim) != (layout.kind, layout.num_kv_heads, layout.head_dim):
                raise ValueError(f"{cfg.spec.method} layers need a {own.kind} pool of {own.num_kv_heads} kv heads of "
                                 f"{own.head_dim} per rank to share the target pool, which is {layout.kind} with "
                                 f"{layout.num_kv_heads} of {layout.head_dim}")
            layout = replace(layout, num_layers=layout.num_layers + own.num_layers)
        budget = rank_kv_budget_bytes(fraction, cfg.kv, ctx.device, ctx.num_ranks_on_host)
        target_kernels = self.model.kernel_page_sizes
        mla_kernel = rank_value("SPECRAY_MLA_KERNEL", ctx.rank)
        if mla_kernel:  # a named MLA decode kernel's page rule (the CPU path computes either way)
            if arch.mla is None:
                raise ValueError(f"SPECRAY_MLA_KERNEL={mla_kernel!r} names an MLA decode kernel, and "
                                 f"{arch.architecture} has no MLA layers")
            target_kernels = mla_kernel_rule(mla_kernel)
        return RankReport(rank=ctx.rank, node=socket.gethostname(), budget_bytes=budget, target_layout=layout,
                          target_kernels=target_kernels,
                          draft_layout=draft_layout, draft_kernels=draft_kernels,
                          state_layout=self.model.state_layout)

    @property
    def num_drafts(self) -> list[int] | None:
        """Drafts verified per scheduled sequence in the last step (fewer than k, or none, where
        the drafter proposed less), or None without a drafter."""
        return self.spec.num_drafts if self.spec is not None else None

    def _apply_deltas(self, plan: StepPlan) -> None:
        for sid in plan.finished:
            self.block_tables.pop(sid, None)
            self.state_rows.pop(sid, None)
            self.samplers.pop(sid, None)
            self.grammars.drop(sid)
        for sid in plan.preempted:
            self.block_tables[sid] = []
        self.state_rows.update(plan.state_rows)
        for sid, (params, seed) in plan.new_seqs.items():
            gen = torch.Generator(device=self.ctx.device).manual_seed(seed)
            self.samplers[sid] = (params, gen)
            if params.structured is not None:
                self.grammars.add(sid, params.structured)
        for sid, (num_blocks, _) in plan.truncated.items():  # rollback of rejected drafts
            del self.block_tables.setdefault(sid, [])[num_blocks:]
        for sid, blocks in zip(plan.seq_ids, plan.new_blocks):
            self.block_tables.setdefault(sid, []).extend(blocks)

    def execute(self, plan: StepPlan) -> list[int] | list[list[int]]:
        """Run one step; returns the sampled token of every scheduled sequence (with a drafter:
        the list of its new tokens, accepted drafts plus the bonus token).

        Every rank runs this on the same plan and must sample the same tokens: checked per
        step in ``check_every_step`` mode, and by a digest at the end of each call."""
        if self.barrier_waits is not None:
            self.barrier_waits.begin()
        tokens = self._forward_and_sample(plan)
        if self.barrier_waits is not None:
            self.barrier_waits.end()
        if tokens:
            self.num_steps += 1
            if self.ctx.cpu.size > 1:  # compared between ranks at the call's end; one rank has none to match
                self.token_digest = fold(self.token_digest, tokens)
                self.table_digest = fold(self.table_digest, [self.block_tables[sid] for sid in plan.seq_ids])
            if self._step_file is not None:  # lets a test act while a call is surely in progress
                self._step_file.write_text(str(self.num_steps))
            if self.config.parallel.check_every_step:
                check_same_on_every_rank(self.ctx.cpu, (plan.seq_ids, tokens), f"step {self.num_steps} tokens")
        if plan.is_call_end:
            check_same_on_every_rank(self.ctx.cpu, (self.num_steps, self.token_digest, self.table_digest),
                                     "(steps, token digest, block-table digest) at the end of the generate call")
        return tokens

    def commit_states(self, seq_ids: list[int], num_drafts: list[int], num_accepted: list[int]) -> None:
        """After a verify on a hybrid target, commit in every linear layer the state after each
        sequence's accepted drafts (``models/linear_state.py``); every rank accepted the same."""
        states = [self.pools[i] for i in self.arch.linear_layers]
        commit_accepted(states, [self.state_rows[sid] for sid in seq_ids], num_drafts, num_accepted)

    def num_top(self, sid: int, prompt: bool = False) -> int | None:
        """How many top log-probabilities sequence ``sid`` asked for (None: none at all)."""
        params = self.samplers[sid][0]
        return params.prompt_logprobs if prompt else params.logprobs

    def output_logprobs(self, seq_ids: list[int], rows: list, tokens: list[list[int]]) -> list | None:
        """Per sequence, the log-probabilities of its new tokens (row j of ``rows[i]`` predicts
        ``tokens[i][j]``), or None when no sequence of the step asked: then nothing is computed."""
        return rows_logprobs(rows, tokens, [self.num_top(sid) for sid in seq_ids])

    @torch.inference_mode()
    def _forward_and_sample(self, plan: StepPlan) -> list[int] | list[list[int]]:
        self._apply_deltas(plan)
        self.step_logprobs, self.step_prompt_logprobs = None, {}
        if self.spec is not None and not self.spec.runs_plain(plan):
            return self.spec.execute(plan)
        if not plan.seq_ids:
            if self.spec is not None:
                self.spec.observe_plain(plan, [])
            return []
        tokens = self._plain_step(plan)
        if self.spec is not None:  # no row drafted: the drafter's mirror still follows (spec_step.py)
            self.spec.observe_plain(plan, tokens)
        return tokens

    def _plain_step(self, plan: StepPlan) -> list[int]:
        tables = [self.block_tables[sid] for sid in plan.seq_ids]
        query_lens = [len(ids) for ids in plan.input_ids]
        positions, meta = build_metadata(tables, self.geometry["target"].tokens_per_block, plan.start_positions,
                                         query_lens, self.ctx.device)
        if "state" in self.geometry:
            meta.state_rows = [self.state_rows[sid] for sid in plan.seq_ids]
        ids = torch.tensor([t for seq in plan.input_ids for t in seq], dtype=torch.int64, device=self.ctx.device)
        if self.spec is None:
            hidden = self.model(ids, positions, self.pools, meta)
        else:  # a step with no drafts: the drafter keeps the features it needs of it (spec_step.py)
            hidden = self.spec.target_forward(ids, positions, meta)
        self.step_prompt_logprobs = compute_prompt_logprobs(
            self.model, hidden, plan, query_lens, {sid: self.num_top(sid, prompt=True) for sid in plan.prompt_logprobs})
        if len(ids) != len(query_lens):  # a decode step (one row a sequence) needs no gather
            hidden = hidden[last_rows(query_lens, hidden.device)]
        # a partial prefill chunk samples nothing (its generator must not move)
        rows = [i for i, sid in enumerate(plan.seq_ids) if sid not in plan.partial]
        if not rows:
            return [None] * len(plan.seq_ids)
        seq_ids = [plan.seq_ids[i] for i in rows]
        logits = self.model.logits(hidden if len(rows) == len(plan.seq_ids) else hidden[rows])
        tokens = sample_rows(self.grammars.masked(seq_ids, logits), [self.samplers[sid] for sid in seq_ids])
        if self.grammars.seqs:
            for sid, token in zip(seq_ids, tokens):
                self.grammars.accept(sid, token)
        logprobs = self.output_logprobs(seq_ids, logits[:, None], [[t] for t in tokens])
        if len(rows) == len(plan.seq_ids):
            self.step_logprobs = logprobs
            return tokens
        self.step_logprobs = None if logprobs is None else spread(logprobs, rows, len(plan.seq_ids))
        return spread(tokens, rows, len(plan.seq_ids))
