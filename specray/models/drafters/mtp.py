"""``mtp``: the multi-token-prediction modules that ship inside the target checkpoint
(DeepSeek-V3 and Qwen3-Next layouts, mtp_format.py), drafting for the target they belong to.

One-model drafter: each module used keeps its KV as one extra layer of the target's pool,
under the target's block tables. Draft position p pairs a hidden state for position p with
the embedding of token p + 1 and predicts token p + 2 (embedding first in the concatenation,
as DeepSeek-V3's, vLLM's, SGLang's and speculators' MTP layers concatenate):

    x_p = proj([enorm(embed(t_{p+1})); hnorm(h_p)])     proj = eh_proj | mtp.fc; embed = the target's
    g_p = block(x_p)                                    the target family's decoder block
    DeepSeek-V3: logits = shared_head.head(shared_head.norm(g_p)); fed back: g_p
    Qwen3-Next:  o_p = mtp.norm(g_p); logits = the target's lm_head(o_p); fed back: o_p

h_p is the target's final hidden state (after its norm, as vLLM and SGLang pass it) for
verified positions, and what the module fed back for draft positions. Draft j (0-based) uses
module min(j, n - 1): k above the number of modules reuses the last one. Each step catches up
every module used on the positions verified since the last step, from the target's hidden
states, so each module's KV covers the whole sequence; then drafts autoregressively. The
hidden states of speculative positions are the drafter's own, so those positions are
recomputed next step (``reuses_draft_kv`` False).

Sharding (tp ranks):

| module                     | split                          | reduce          |
|----------------------------|--------------------------------|-----------------|
| eh_proj / mtp.fc           | replicated                     | -               |
| decoder block (dense, MoE) | as decoder.py (the target's)   | all_reduce      |
| shared_head.head           | vocab rows over tp             | all_gather      |
| norms                      | replicated                     | -               |
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from specray.comm.context import DistContext
from specray.models.arch import ModelArch, arch_from_hf_config
from specray.models.attention import build_metadata
from specray.models.decoder import Attention, CausalLM, DecoderLayer
from specray.models.drafters.common import (FINAL_HIDDEN, Choose, DraftBatch, ReplicatedLinear, catch_up_rows,
                                            last_rows)
from specray.models.drafters.mtp_format import DEEPSEEK_V3, MTPFormat, read_mtp_format
from specray.models.fused_decode import add_mlp_block, layer_tables, lone_layer_kernels
from specray.models.layers import ParallelLMHead, RMSNorm
from specray.models.mla import rotary_for
from specray.models.qwen3_next import ZeroCentredRMSNorm
from specray.models.loader import CheckpointReader


class MTPModule(nn.Module):
    """One MTP module: input norms, the projection, a decoder block and its output head."""

    def __init__(self, fmt: MTPFormat, i: int, ctx: DistContext, dtype: torch.dtype):
        super().__init__()
        a, dev = fmt.arch, ctx.device
        h, eps = a.hidden_size, a.rms_norm_eps
        self.fmt, self.i = fmt, i
        self.is_deepseek = fmt.layout == DEEPSEEK_V3
        norm = RMSNorm if self.is_deepseek else ZeroCentredRMSNorm
        self.enorm, self.hnorm, self.out_norm = (norm(h, eps, dtype, dev) for _ in range(3))
        self.proj = ReplicatedLinear(2 * h, h, dtype, dev)
        index = fmt.arch.num_layers + i  # the block's layer index, which decides dense or MoE
        self.block_arch = dataclasses.replace(a, moe_layers=(index,) if fmt.is_moe[i] else ())
        self.block = DecoderLayer(self.block_arch, index, ctx, dtype)
        attn = getattr(self.block, "self_attn", None)
        # fused_layer.c's blocks serve a GQA block with RMSNorms (not MLA, gated attention or
        # Qwen3-Next's zero-centred norms; step_kernels checks the rest, MoE included, each step)
        self.is_fused = type(attn) is Attention and not attn.is_gated and type(self.block.input_layernorm) is RMSNorm
        self.head = ParallelLMHead(a.vocab_size, h, ctx.tp, dtype, dev) if self.is_deepseek else None

    @torch.no_grad()
    def load(self, reader) -> None:
        p = self.fmt.prefix(self.i)
        names = ((f"{p}.enorm", f"{p}.hnorm", f"{p}.eh_proj", f"{p}.shared_head.norm") if self.is_deepseek else
                 ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.fc", "mtp.norm"))
        self.enorm.load(reader, f"{names[0]}.weight")
        self.hnorm.load(reader, f"{names[1]}.weight")
        self.proj.load(reader, f"{names[2]}.weight")
        self.out_norm.load(reader, f"{names[3]}.weight")
        self.block.load(reader, p)
        if self.head is not None:
            self.head.load(reader, f"{p}.shared_head.head")

    def forward(self, target: CausalLM, rotary, ids, h, positions, pool, meta,
                rows) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits, fed-back hidden state) at ``rows``; the block's KV is written at every row
        (``rows`` None: only that, a catch-up)."""
        x = self.proj(torch.cat([self.enorm(target.embed_tokens(ids)), self.hnorm(h)], dim=-1))
        kernels = lone_layer_kernels(self, self.block_arch, x, pool, meta, [self.block]) if self.is_fused else None
        if kernels is not None:  # the block in fused_layer.c's two blocks, its all-reduces between
            block, attn, eps = self.block, self.block.self_attn, self.block_arch.rms_norm_eps
            row, step, shape = layer_tables(self, rotary, x, positions, block.input_layernorm.weight, attn,
                                            block.post_attention_layernorm.weight, block.mlp, pool, meta)
            o = kernels.attention_block(row, shape, step, eps, attn.scale, x, None, None)
            g = add_mlp_block(kernels, row, shape, eps, x, o, attn, block.mlp)
        else:
            cos, sin = rotary(positions, max(meta.context_lens_list))
            g = self.block(x, cos, sin, pool, meta)
        if rows is None:
            return None
        g = g[rows]
        out = self.out_norm(g)
        if self.is_deepseek:
            return self.head(out), g
        return target.logits(out), out


class MTPDrafter(nn.Module):
    is_standalone = False
    reuses_draft_kv = False
    feature_layers = (FINAL_HIDDEN,)
    kv_successor_tokens = 1  # its KV at position p pairs with token p + 1: prefix-cache keys include it

    def __init__(self, fmt: MTPFormat, target: CausalLM, ctx: DistContext, dtype: torch.dtype, k: int):
        super().__init__()
        a = fmt.arch
        self.fmt = fmt
        self.target = [target]  # a list so the target's modules are not registered twice
        self.rotary = rotary_for(a, ctx.device)  # the target's RoPE (YaRN on DeepSeek-V3)
        # draft j uses module min(j, n - 1): only the first min(k, n) are ever run, or given KV
        self.mtp = nn.ModuleList(MTPModule(fmt, i, ctx, dtype) for i in range(min(k, fmt.num_modules)))
        self.kv_layout = self.mtp[0].block.self_attn.layout(len(self.mtp))  # K/V or latent rows, as the target

    @torch.no_grad()
    def load(self, reader) -> None:
        for module in self.mtp:
            module.load(reader)

    def _run(self, m: int, batch: DraftBatch, ids, h, starts: list[int], lens: list[int], is_catch_up: bool = False):
        positions, meta = build_metadata([s.block_table for s in batch.seqs], batch.block_size, starts, lens,
                                         batch.device)
        rows = None if is_catch_up else last_rows(lens, batch.device)
        return self.mtp[m](self.target[0], self.rotary, ids, h, positions, batch.pools[m], meta, rows)

    def catch_up(self, batch: DraftBatch) -> None:
        """Every module's KV at positions [consumed, L - 2) of each sequence, drafting nothing
        (common.catch_up_rows: the last position stays for the next draft's first forward)."""
        starts, lens, ids, features = catch_up_rows(batch)
        for m in range(len(self.mtp)):
            self._run(m, batch, ids, features, starts, lens, is_catch_up=True)

    def propose(self, batch: DraftBatch, choose: Choose) -> torch.Tensor:
        seqs = batch.seqs
        # catch-up: positions [consumed, L - 1) pair the target's hidden states with tokens consumed+1 .. L-1,
        # in every module used (the later ones only for their KV)
        starts = [s.num_consumed for s in seqs]
        lens = [len(s.tokens) - 1 - s.num_consumed for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.tokens[s.num_consumed + 1:]], device=batch.device)
        features = torch.cat([s.features for s in seqs])
        outputs = [self._run(m, batch, ids, features, starts, lens) for m in range(len(self.mtp))]
        logits, h = outputs[0]
        drafts = [choose(logits, 0)]
        for j in range(1, batch.k):
            starts = [len(s.tokens) - 2 + j for s in seqs]
            logits, h = self._run(min(j, len(self.mtp) - 1), batch, drafts[-1], h, starts, [1] * len(seqs))
            drafts.append(choose(logits, j))
        return torch.stack(drafts, dim=1)


def mtp_checkpoint(model_path: Path, draft_model: Path | None) -> Path:
    """Where the MTP weights are: the target's own checkpoint, or the one ``draft_model`` names."""
    path = draft_model if draft_model is not None else model_path
    if not Path(path).is_dir():
        raise ValueError(f"spec method 'mtp' reads the MTP modules inside the target checkpoint, and {str(path)!r} "
                         f"is not a checkpoint directory (a GGUF file carries no MTP modules specray reads)")
    return Path(path)


def read_mtp(path: Path, target: ModelArch, reader: CheckpointReader) -> MTPFormat:
    """The MTP modules of checkpoint ``path``, checked against the target and tensor by tensor
    (names and shapes from the checkpoint's header: no weight is read)."""
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"mtp checkpoint {str(path)!r} has no config.json")
    cfg = json.loads(file.read_text())
    if "SpecrayMTPDrafter" in (cfg.get("architectures") or []):
        arch = target  # read_mtp_format stops with the deprecation error first
    else:
        arch = arch_from_hf_config(cfg, source=str(file))
    return read_mtp_format(cfg, arch, target, reader, str(path))


def load_mtp_drafter(path: Path, num_draft_tokens: int, ctx: DistContext, dtype: str, target: CausalLM) -> MTPDrafter:
    """The MTP drafter of checkpoint ``path`` (the target's own, or a copy with MTP weights) on this rank."""
    torch_dtype = getattr(torch, dtype)
    reader = CheckpointReader(path, torch_dtype, ctx.device)
    try:
        drafter = MTPDrafter(read_mtp(path, target.arch, reader), target, ctx, torch_dtype, num_draft_tokens)
        drafter.load(reader)
    finally:
        reader.close()
    return drafter.eval()
