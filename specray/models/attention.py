"""Paged attention over a KV pool (torch on CPU, any device torch runs on).

A pool layer is a tensor ``[num_blocks, 2, kv_heads, tokens_per_block, head_dim]``; token
``t`` of a sequence lives in block ``block_table[t // B]`` at offset ``t % B``. The caller
writes the step's new K/V through ``slot_mapping`` (``block * B + offset`` per new token)
with ``write_kv``, then calls a kernel, which attends each query to every cached token of
its sequence up to its own position.

Callers must pass, per sequence, the number of new tokens (``query_lens``) and the total
length after this step (``context_lens``); the new tokens are the last ``query_len`` ones.
Kernels take ``(q, k, v, pool, meta, scale)``: ``k`` and ``v`` are the step's new keys and
values, already in the pool; a kernel may read them instead of the pool where a sequence
has nothing cached before this step (a whole prompt).

The pool is zeroed when allocated, so slots past a sequence's length always hold finite
values (zeros or stale K/V of a finished sequence): batched kernels read whole pages and
mask by length, and a masked finite value contributes exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F

from specray.models.cpu_kernels import CpuKernels, kernels_for

# Kernel capability: the page sizes this kernel accepts. It gathers whole pages with an
# index and masks by length, so any power of two works; powers of two keep the slot
# arithmetic (t // B, t % B) to shifts and match the configured range.
PAGED_ATTENTION_PAGE_SIZES = frozenset(2**i for i in range(3, 9))


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64: where each new token's K/V is written
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [S] int64: tokens in the cache after this step
    query_lens: list[int]  # new tokens per sequence, summing to N
    causal: bool = True
    context_lens_list: list[int] = field(default_factory=list)  # context_lens as ints (filled if empty)
    state_rows: list[int] = field(default_factory=list)  # hybrid models: each sequence's state row (kv/state.py)
    # hybrid models in a verify step: drafts fed per sequence (its linear layers keep a state per position)
    num_drafts: list[int] = field(default_factory=list)
    # what kernels derive from the metadata, built by the first layer and reused by the others
    derived: dict = field(default_factory=dict, repr=False)
    # query_lens and each sequence's first query row as int64 tensors, where build_metadata made them
    query_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not self.context_lens_list:
            self.context_lens_list = self.context_lens.tolist()


def build_metadata(tables: list[list[int]], block_size: int, starts: list[int], query_lens: list[int],
                   device: torch.device, *, causal: bool = True) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) for ``query_lens[i]`` new tokens of sequence i at positions
    ``starts[i] ...``. Causal: each query sees the keys up to its own position; otherwise every
    query sees all keys up to the last new token."""
    width = max(1, max(len(t) for t in tables))
    positions = [p for start, n in zip(starts, query_lens) for p in range(start, start + n)]
    slots = [table[p // block_size] * block_size + p % block_size
             for table, start, n in zip(tables, starts, query_lens) for p in range(start, start + n)]
    ends = [p + n for p, n in zip(starts, query_lens)]
    firsts = [0, *accumulate(query_lens[:-1])]
    # every array of the step in one tensor, handed out as views: a tensor made from a list costs
    # ~7 us in a decode step (Python's data evicted by the weights), six of them a tenth of a
    # small model's step
    rows, seqs = len(positions), len(tables)
    values = torch.tensor(positions + slots + ends + list(query_lens) + firsts
                          + [b for t in tables for b in t + [0] * (width - len(t))], dtype=torch.int64, device=device)
    positions_t, slots_t, ends_t, lens_t, firsts_t, tables_t = values.split_with_sizes(
        [rows, rows, seqs, seqs, seqs, seqs * width])
    meta = AttentionMetadata(slot_mapping=slots_t, block_tables=tables_t.view(seqs, width), context_lens=ends_t,
                             query_lens=list(query_lens), causal=causal, context_lens_list=ends,
                             query_rows=(lens_t, firsts_t))
    return positions_t, meta


def write_kv(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v ([N, kv_heads, head_dim]) into their slots of one pool layer."""
    block_size = pool.shape[3]
    pool[slot_mapping // block_size, :, :, slot_mapping % block_size] = torch.stack((k, v), dim=1)


def query_layout(query_lens: list[int], context_lens: list[int], causal: bool, num_keys: int,
                 device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor]:
    """For batched kernels that pad every sequence's queries to the longest (n) and its keys
    to ``num_keys``: the (sequence, row) of each real query, or None when none is padded, and
    which keys each query sees, [S, 1 or n, num_keys] (by length, and by position when causal).

    Query j of sequence i sits at position context_i - query_len_i + j; a padded row sits at
    or past context_i, so it sees every key and never yields an empty softmax."""
    n = max(query_lens)
    padded = None
    if any(m != n for m in query_lens):
        padded = (torch.tensor([i for i, m in enumerate(query_lens) for _ in range(m)], device=device),
                  torch.tensor([j for m in query_lens for j in range(m)], device=device))
    ctx = torch.tensor(context_lens, device=device)
    key_pos = torch.arange(num_keys, device=device)
    visible = key_pos[None, None, :] < ctx[:, None, None]
    if causal:
        query_pos = ctx[:, None] - torch.tensor(query_lens, device=device)[:, None] + torch.arange(n, device=device)
        visible = visible & (key_pos[None, None, :] <= query_pos[:, :, None])
    return padded, visible


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, heads, head_dim] (already rotated); returns [N, heads, head_dim].

    Whole prompts (causal, nothing cached before them) attend to their own fresh k/v with
    SDPA's causal kernel, one call per prompt; every other sequence (decode, verify rows)
    is served by one batched call over the pool: specray's C kernel reads the pages in place
    where it can (float32 on CPU), torch ops gather them otherwise."""
    plan = step_plan(meta, q, pool)
    if not plan.prompts:
        return plan.attend_cached(q, pool, scale)
    out = torch.empty_like(q)
    for s, e in plan.prompts:
        out[s:e] = _attend_fresh(q[s:e], k[s:e], v[s:e], scale)
    if plan.rows is not None:
        out[plan.rows] = plan.attend_cached(q[plan.rows], pool, scale)
    return out


def step_plan(meta: AttentionMetadata, q: torch.Tensor, pool: torch.Tensor) -> _Plan:
    """The step's plan for pools of this page size: built by the first layer, reused by the rest."""
    key = ("paged", pool.shape[3])
    plan = meta.derived.get(key)
    if plan is None:
        plan = meta.derived[key] = _Plan.build(meta, q, pool)
    return plan


def use_cpu_kernel(q: torch.Tensor, pool: torch.Tensor) -> CpuKernels | None:
    """specray's CPU kernels where they can serve this attention, else None."""
    kernels = kernels_for(pool) if q.dtype == pool.dtype else None
    return kernels if kernels is not None and pool.shape[4] <= kernels.max_head_dim else None


@dataclass(slots=True)
class _Plan:
    """How one step's sequences split between the two paths, and what the batched path needs:
    the same for every layer, so built once per step, for the path that will serve."""

    prompts: list[tuple[int, int]]  # query rows [s, e) of each whole prompt
    rows: torch.Tensor | None  # query rows of the cached sequences (None: all or none are)
    causal: bool
    kernels: CpuKernels | None  # specray's CPU kernels when they serve, else the torch path below
    # C kernel: block tables, context lengths, query lengths, first query row, per sequence
    kernel_args: tuple[torch.Tensor, ...] = ()
    # torch path: pages to gather [S * num_pages], padded query rows, keys each query must not see
    index: torch.Tensor | None = None
    num_pages: int = 0
    n: int = 0
    padded: tuple[torch.Tensor, torch.Tensor] | None = None
    hidden: torch.Tensor | None = None

    @staticmethod
    def build(meta: AttentionMetadata, q: torch.Tensor, pool: torch.Tensor) -> _Plan:
        device, block_size = q.device, pool.shape[3]
        lens, ctx = meta.query_lens, meta.context_lens_list
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        is_prompt = [meta.causal and n == c for n, c in zip(lens, ctx)]
        prompts = [(starts[i], starts[i + 1]) for i, p in enumerate(is_prompt) if p]
        cached = [i for i, p in enumerate(is_prompt) if not p]
        rows = None
        if prompts and cached:
            rows = torch.tensor([r for i in cached for r in range(starts[i], starts[i + 1])], device=device)
        plan = _Plan(prompts, rows, meta.causal, use_cpu_kernel(q, pool))
        if not cached:
            return plan
        lens, ctx = [lens[i] for i in cached], [ctx[i] for i in cached]
        tables = meta.block_tables if not prompts else meta.block_tables[cached]
        if plan.kernels is not None:
            if not prompts and meta.query_rows is not None:  # every sequence: build_metadata's tensors
                plan.kernel_args = (tables.contiguous(), meta.context_lens, *meta.query_rows)
                return plan
            firsts = [0, *accumulate(lens[:-1])]
            plan.kernel_args = (tables.contiguous(), *(torch.tensor(x, device=device) for x in (ctx, lens, firsts)))
            return plan
        plan.num_pages = -(-max(ctx) // block_size)
        plan.n = max(lens)
        plan.index = tables[:, :plan.num_pages].reshape(-1)
        plan.padded, visible = query_layout(lens, ctx, meta.causal, plan.num_pages * block_size, device)
        plan.hidden = ~visible
        return plan

    def attend_cached(self, q: torch.Tensor, pool: torch.Tensor, scale: float) -> torch.Tensor:
        """Every cached sequence at once."""
        if self.kernels is not None:
            return self.kernels.paged_attention(q.contiguous(), pool, *self.kernel_args, self.causal, scale)
        return _attend_gathered(q, pool, self, scale)


def _attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One whole prompt, causal, from its own k/v ([n, heads or kv_heads, dim]). The batch
    dimension of one matters: with 3-d inputs SDPA takes its math path on CPU, which
    materialises every score (8x slower at 3000 tokens than the fused kernel 4-d inputs get)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=q.shape[0] > 1, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _attend_gathered(q: torch.Tensor, pool: torch.Tensor, plan: _Plan, scale: float) -> torch.Tensor:
    """The torch path: gather the sequences' pages (one index_select per K and V), pad the
    queries to the longest, mask what each query must not see."""
    num_seqs, n = plan.hidden.shape[0], plan.n
    kv_heads, block_size, dim = pool.shape[2], pool.shape[3], pool.shape[4]
    heads = q.shape[1]
    group, keys = heads // kv_heads, plan.num_pages * block_size

    def gather(half: int) -> torch.Tensor:  # [S, kv_heads, keys, dim]
        pages = pool[:, half].index_select(0, plan.index).view(num_seqs, plan.num_pages, kv_heads, block_size, dim)
        return pages.transpose(1, 2).reshape(num_seqs, kv_heads, keys, dim)

    k, v = gather(0), gather(1)
    if plan.padded is None:
        qp = q.view(num_seqs, n, heads, dim)
    else:
        qp = q.new_zeros(num_seqs, n, heads, dim)
        qp[plan.padded] = q
    # GQA without repeating K/V: the group's queries of one kv head are rows of one matmul
    qg = qp.view(num_seqs, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, group * n, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(num_seqs, kv_heads, group, n, keys)
    scores = scores.float().mul_(scale).masked_fill_(plan.hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_seqs, kv_heads, group * n, keys)
    o = torch.matmul(probs, v).view(num_seqs, kv_heads, group, n, dim).permute(0, 3, 1, 2, 4)
    o = o.reshape(num_seqs, n, heads, dim)
    return o.reshape(-1, heads, dim) if plan.padded is None else o[plan.padded]
