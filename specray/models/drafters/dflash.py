"""``dflash``: a block drafter conditioned on the target's hidden states (DFlash-style).

Standalone (its own pool, 32- or 64-token pages, block-decode kernel). Per step, for a
sequence of L tokens whose target KV covers positions [0, L - 1):

1. context injection: the target's residual streams after ``target_layer_ids`` at the
   positions verified since the last step are concatenated, projected (``fc``) and
   normalised (``hidden_norm``); every draft layer writes that context's K/V (its own k/v
   projections, RoPE at the context positions) into the draft pool;
2. the block [t_{L-1}, mask x k] at positions L-1 .. L+k-1 runs through the layers; its
   queries attend *without a causal mask* to the whole context and the whole block;
3. the outputs at the k mask positions, through the drafter's own final ``norm`` and the
   target's LM head, are drafts 1..k: all k in one forward.

The embedding and the LM head are the target's. Block positions are scratch: next step's
context injection overwrites them, so the cache is valid below L - 1 only.

Checkpoint format (a directory):

- ``config.json``: ``architectures`` = ["SpecrayDFlashDrafter"]; ``target_layer_ids`` (list
  of target layer indices whose outputs form the context); ``block_size`` (the block
  length it was trained for: k must be <= block_size - 1); ``mask_token_id`` (a token of
  the target's vocabulary); ``vocab_size`` (the target's); Llama-style layer sizes
  (``num_hidden_layers``, ``hidden_size`` = the target's, ``intermediate_size``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
  ``rope_theta``);
- ``*.safetensors``: ``fc.weight`` [H, len(target_layer_ids) * H], ``hidden_norm.weight``
  [H], ``norm.weight`` [H], and each layer under ``layers.{i}.`` in Hugging Face Llama
  names (input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
  mlp.{gate,up,down}_proj).

Sharding: fc replicated; the layers as in decoder.py (heads and MLP over tp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.comm.context import DistContext
from specray.kv.geometry import KVLayout
from specray.models.arch import ModelArch
from specray.models.attention import build_metadata, write_kv
from specray.models.block_attention import block_decode_attention
from specray.models.decoder import CausalLM, DecoderLayer
from specray.models.drafters.common import Choose, DraftBatch, ReplicatedLinear
from specray.models.layers import RMSNorm, RotaryEmbedding, apply_rope


class DFlashDrafter(nn.Module):
    is_standalone = True
    reuses_draft_kv = False

    def __init__(self, arch: ModelArch, target: CausalLM, ctx: DistContext, dtype: torch.dtype,
                 target_layer_ids: tuple[int, ...], block_size: int, mask_token_id: int):
        super().__init__()
        h, dev, eps = arch.hidden_size, ctx.device, arch.rms_norm_eps
        self.arch = arch
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, dev)
        self.feature_layers = tuple(target_layer_ids)
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.target = [target]  # a list so the target's modules are not registered twice
        self.fc = ReplicatedLinear(len(target_layer_ids) * h, h, dtype, dev)
        self.hidden_norm = RMSNorm(h, eps, dtype, dev)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, ctx, dtype, block_decode_attention)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(h, eps, dtype, dev)
        self.kv_layout = KVLayout(arch.num_layers, self.layers[0].self_attn.num_local_kv_heads, arch.head_dim)

    @torch.no_grad()
    def load(self, reader) -> None:
        self.fc.load(reader, "fc.weight")
        self.hidden_norm.load(reader, "hidden_norm.weight")
        self.norm.load(reader, "norm.weight")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"layers.{i}")

    @staticmethod
    def _write_context(layer: DecoderLayer, context: torch.Tensor, cos, sin, pool, slots) -> None:
        """K/V of the injected context through this layer's own k/v projections."""
        attn = layer.self_attn
        q_size, kv_size = attn.qkv.out_sizes[0], attn.qkv.out_sizes[1]
        k, v = F.linear(context, attn.qkv.weight[q_size:]).split([kv_size, kv_size], dim=-1)
        k = k.view(-1, attn.num_local_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_local_kv_heads, attn.head_dim)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        write_kv(pool, apply_rope(k, cos, sin), v, slots)

    def propose(self, batch: DraftBatch, choose: Choose) -> torch.Tensor:
        seqs, k, dev = batch.seqs, batch.k, batch.device
        tables = [s.block_table for s in seqs]
        ctx_starts = [s.num_consumed for s in seqs]
        ctx_lens = [len(s.tokens) - 1 - s.num_consumed for s in seqs]
        ctx_pos, ctx_meta = build_metadata(tables, batch.block_size, ctx_starts, ctx_lens, dev)
        ctx_cos, ctx_sin = self.rotary(ctx_pos, max(ctx_meta.context_lens_list))
        context = self.hidden_norm(self.fc(torch.cat([s.features for s in seqs])))

        starts = [len(s.tokens) - 1 for s in seqs]
        positions, meta = build_metadata(tables, batch.block_size, starts, [k + 1] * len(seqs), dev, causal=False)
        cos, sin = self.rotary(positions, max(meta.context_lens_list))
        ids = torch.tensor([t for s in seqs for t in [s.tokens[-1]] + [self.mask_token_id] * k], device=dev)
        x = self.target[0].embed_tokens(ids)
        for layer, pool in zip(self.layers, batch.pools):
            self._write_context(layer, context, ctx_cos, ctx_sin, pool, ctx_meta.slot_mapping)
            x = layer(x, cos, sin, pool, meta)
        masks = x.view(len(seqs), k + 1, -1)[:, 1:].reshape(len(seqs) * k, -1)  # row 0 (t_{L-1}) drafts nothing
        logits = self.target[0].logits(self.norm(masks)).view(len(seqs), k, -1)
        return torch.stack([choose(logits[:, j], j) for j in range(k)], dim=1)
