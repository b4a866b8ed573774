"""The decoder shared by every supported family (Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 /
Kimi-K2, Qwen3-Next, Kimi Linear). A layer is assembled from parts the architecture record names:
its token mixer (``Attention`` here, gated or not, ``MLAttention`` in mla.py, ``GatedDeltaNet`` in
qwen3_next.py, ``KimiDeltaAttention`` in kimi_linear.py) and its MLP (dense here, ``MoE``, ``DeepSeekMoE`` in moe.py or
``SharedExpertMoE`` in qwen3_next.py). Their sharding tables are in those files.

Sharding over the tensor-parallel group (tp ranks, moe_tp * moe_ep == tp):

| module                   | split                                              | reduce                  |
|--------------------------|----------------------------------------------------|-------------------------|
| embed_tokens             | vocab rows over tp                                 | all_reduce (tp)         |
| self_attn.qkv            | q heads over tp; kv heads over tp or replicated    | -                       |
| self_attn.o_proj         | input columns (heads) over tp                      | all_reduce (tp)         |
| mlp.gate_up / down       | intermediate over tp                               | all_reduce (tp)         |
| self_attn (MLA)          | q_b/kv_b by head, latent projections replicated    | all_reduce (tp), mla.py |
| moe experts              | contiguous expert groups over moe_ep; each         | one all_reduce (tp)     |
|                          | expert's intermediate over moe_tp (moe.py)         | sums both splits        |
| moe router (gate)        | replicated                                         | -                       |
| norms                    | replicated                                         | -                       |
| lm_head                  | vocab rows over tp                                 | all_gather (tp)         |
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.comm.context import DistContext
from specray.kv.geometry import KVLayout
from specray.kv.state import StateLayout, StatePool
from specray.models.arch import ModelArch
from specray.models.attention import PAGED_ATTENTION_PAGE_SIZES, AttentionMetadata, paged_attention, write_kv
from specray.models.block_attention import block_decode_attention
from specray.models.cpu_kernels import kernels_for
from specray.models.fused_decode import fused_kernels, fused_layers, fused_layers_enabled
from specray.models.mla import MLA_CPU_PAGE_SIZES, MLAttention, rotary_for
from specray.models.moe import DeepSeekMoE, MoE
from specray.models.kimi_linear import KimiDeltaAttention
from specray.models.quant_weight import set_weight
from specray.models.linear_state import LayerState
from specray.models.qwen3_next import GatedDeltaNet, SharedExpertMoE, ZeroCentredRMSNorm, gated_attention_forward
from specray.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rope,
)


def norm_class(arch: ModelArch) -> type[RMSNorm]:
    """The model's RMSNorm: ``x * w``, or zero-centred ``x * (1 + w)`` (Qwen3-Next)."""
    return ZeroCentredRMSNorm if arch.is_zero_centred_norm else RMSNorm


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, ctx: DistContext, dtype: torch.dtype, kernel=paged_attention,
                 is_gated: bool = False):
        super().__init__()
        self.kernel = kernel  # paged_attention, or block_decode_attention in standalone drafters
        tp, dev = ctx.tp, ctx.device
        self.head_dim = arch.head_dim
        self.num_local_heads = arch.num_heads // tp.size
        # a gated layer's q_proj holds (q, gate) per head: twice the rows, still split by head
        self.is_gated = is_gated
        q_parts = 2 if is_gated else 1
        self.qkv = QKVParallelLinear(arch.hidden_size, q_parts * arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                     tp, arch.attention_bias, dtype, dev)
        self.num_local_kv_heads = self.qkv.num_local_kv_heads
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, tp,
                                        arch.attention_bias, dtype, dev)
        self.q_norm = self.k_norm = None
        if arch.family.has_qk_norm:
            self.q_norm = norm_class(arch)(arch.head_dim, arch.rms_norm_eps, dtype, dev)
            self.k_norm = norm_class(arch)(arch.head_dim, arch.rms_norm_eps, dtype, dev)
        self.scale = arch.head_dim ** -0.5

    def layout(self, num_layers: int) -> KVLayout:
        """K and V per kv head on this rank."""
        return KVLayout(num_layers, self.num_local_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.is_gated:
            return gated_attention_forward(self, x, cos, sin, pool, meta)
        heads, kv_heads, dim = self.num_local_heads, self.num_local_kv_heads, self.head_dim
        qkv = self.qkv(x)
        kernels = kernels_for(qkv, pool) if self.q_norm is None else None
        if kernels is not None:  # RoPE and the K/V store in one call
            q, k = kernels.rope_store_kv(qkv, cos, sin, heads, kv_heads, pool, meta.slot_mapping)
            v = qkv.view(-1, heads + 2 * kv_heads, dim)[:, heads + kv_heads:]
        else:
            qkv = qkv.view(-1, heads + 2 * kv_heads, dim)
            qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads:]
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
            q, k = apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1)  # q and k rotated in one pass
            write_kv(pool, k, v, meta.slot_mapping)
        o = self.kernel(q, k, v, pool, meta, self.scale)
        return self.o_proj(o.reshape(o.shape[0], -1))

    def load(self, reader, prefix: str) -> None:
        self.qkv.load(reader, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
        self.o_proj.load(reader, f"{prefix}.o_proj")
        if self.q_norm is not None:
            self.q_norm.load(reader, f"{prefix}.q_norm.weight")
            self.k_norm.load(reader, f"{prefix}.k_norm.weight")


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, ctx: DistContext, dtype: torch.dtype):
        super().__init__()
        self.gate_up = ColumnParallelLinear(hidden, [intermediate, intermediate], ctx.tp, False, dtype, ctx.device)
        self.down = RowParallelLinear(intermediate, hidden, ctx.tp, False, dtype, ctx.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def load(self, reader, prefix: str) -> None:
        self.gate_up.load(reader, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down.load(reader, f"{prefix}.down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int, ctx: DistContext, dtype: torch.dtype, kernel=paged_attention):
        super().__init__()
        dev, norm = ctx.device, norm_class(arch)
        self.input_layernorm = norm(arch.hidden_size, arch.rms_norm_eps, dtype, dev)
        # the record's per-layer mixer: (gated) GQA attention over a K/V pool, MLA over a latent pool,
        # or Gated DeltaNet / KDA over a state slot; Qwen3-Next's checkpoints name Gated DeltaNet
        # linear_attn, Kimi Linear's name KDA self_attn
        mixer = arch.mixer_of(index)
        self.mixer_name = "linear_attn" if mixer == "linear_attention" else "self_attn"
        if mixer == "mla":
            self.self_attn = MLAttention(arch, ctx, dtype)
        elif mixer == "linear_attention":
            self.linear_attn = GatedDeltaNet(arch, ctx, dtype)
        elif mixer == "kda":
            self.self_attn = KimiDeltaAttention(arch, ctx, dtype)
        else:
            self.self_attn = Attention(arch, ctx, dtype, kernel, is_gated=mixer == "gated_attention")
        self.post_attention_layernorm = norm(arch.hidden_size, arch.rms_norm_eps, dtype, dev)
        self.is_moe = index in arch.moe_layers
        self.mlp_prefixes = (arch.family.moe_prefix,) if self.is_moe else arch.family.dense_prefixes
        if self.is_moe and arch.shared_expert_intermediate_size:
            self.mlp = SharedExpertMoE(arch, ctx, dtype)
        elif self.is_moe and arch.router is not None:
            self.mlp = DeepSeekMoE(arch, ctx, dtype)
        else:
            self.mlp = MoE(arch, ctx, dtype) if self.is_moe else MLP(arch.hidden_size, arch.intermediate_size, ctx, dtype)

    def forward(self, x, cos, sin, pool, meta):
        x = x + getattr(self, self.mixer_name)(self.input_layernorm(x), cos, sin, pool, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def load(self, reader, prefix: str) -> None:
        self.input_layernorm.load(reader, f"{prefix}.input_layernorm.weight")
        self.post_attention_layernorm.load(reader, f"{prefix}.post_attention_layernorm.weight")
        getattr(self, self.mixer_name).load(reader, f"{prefix}.{self.mixer_name}")
        mlp = next((p for p in self.mlp_prefixes if reader.has(f"{prefix}.{p}.gate_proj.weight")), self.mlp_prefixes[0])
        self.mlp.load(reader, f"{prefix}.{mlp}")


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head, over paged KV pools."""

    def __init__(self, arch: ModelArch, ctx: DistContext, dtype: torch.dtype, kernel=paged_attention):
        super().__init__()
        self.arch = arch
        dev = ctx.device
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, ctx.tp, dtype, dev)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, ctx, dtype, kernel) for i in range(arch.num_layers))
        self.norm = norm_class(arch)(arch.hidden_size, arch.rms_norm_eps, dtype, dev)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, ctx.tp, dtype, dev)
        self.rotary = rotary_for(arch, dev)
        # fused_layers runs these kernels' maths (GQA layers only); SPECRAY_CPU_FUSED_LAYERS=0 keeps the module path
        self.is_fused = ((kernel is paged_attention or kernel is block_decode_attention) and fused_layers_enabled()
                         and arch.mla is None and not arch.linear_layers)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[self.arch.kv_layers[0]].self_attn.num_local_kv_heads

    @property
    def kv_layout(self) -> KVLayout:
        """What one token needs in this rank's pool, over the model's paged layers (kind kv or
        latent; a hybrid model's linear layers keep state slots instead)."""
        return self.layers[self.arch.kv_layers[0]].self_attn.layout(len(self.arch.kv_layers))

    @property
    def state_layout(self) -> StateLayout | None:
        """What one sequence needs in this rank's state pool, or None without linear layers."""
        if not self.arch.linear_layers:
            return None
        layer = self.layers[self.arch.linear_layers[0]]
        mixer = getattr(layer, layer.mixer_name)  # Gated DeltaNet or KDA: the same state layout
        return StateLayout(num_layers=len(self.arch.linear_layers), conv_dim=mixer.conv_dim,
                           conv_kernel_size=mixer.lin.conv_kernel_size, num_heads=mixer.num_v_heads,
                           k_head_dim=mixer.lin.k_head_dim, v_head_dim=mixer.lin.v_head_dim)

    def layer_pools(self, pages: list[torch.Tensor], state: StatePool | None) -> list:
        """Per layer, what it reads and writes: its page pool (full-attention layers, in order) or its
        state (``LayerState``, linear layers): the list ``forward`` takes as ``pools``."""
        if state is None:
            return pages
        pools, paged, linear = [], iter(pages), iter(zip(state.conv, state.recurrent))
        linear_layers = set(self.arch.linear_layers)
        for i in range(self.arch.num_layers):
            pools.append(LayerState(*next(linear)) if i in linear_layers else next(paged))
        return pools + list(paged)  # a one-model drafter's layers come last

    @property
    def kernel_page_sizes(self) -> dict[str, frozenset[int]]:
        """The attention kernels this rank runs for the target and the page sizes each accepts."""
        if self.arch.mla is not None:
            return {"mla_cpu": MLA_CPU_PAGE_SIZES}
        return {"paged_attention": PAGED_ATTENTION_PAGE_SIZES}

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, pools: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = ()):
        """Hidden states after the final norm, one row per new token.

        With ``capture_layers`` (speculative drafters conditioned on the target), returns
        ``(hidden, captured)``: ``captured[i]`` is the residual stream after layer
        ``capture_layers[i]`` (a list, or one [captures, rows, hidden] tensor from the fused
        kernel; ``side_by_side`` joins either). ``pools`` may hold more layers than the model (a
        one-model drafter's layers come last); the model uses the first ``num_layers``."""
        x = self.embed_tokens(ids)
        kernels = fused_kernels(self, x, pools, meta) if self.is_fused else None
        if kernels is not None:  # decode and verify on CPU: Python once per step (fused_decode.py)
            x, captured_list = fused_layers(self, kernels, x, positions, pools, meta, capture_layers)
            return (self.norm(x), captured_list) if capture_layers else self.norm(x)
        cos, sin = self.rotary(positions, max(meta.context_lens_list))
        captured = {}
        for i, (layer, pool) in enumerate(zip(self.layers, pools)):
            x = layer(x, cos, sin, pool, meta)
            if i in capture_layers:
                captured[i] = x
        hidden = self.norm(x)
        if capture_layers:
            return hidden, [captured[i] for i in capture_layers]
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank."""
        return self.lm_head(hidden)

    @torch.no_grad()
    def load(self, reader) -> None:
        self.embed_tokens.load(reader, "model.embed_tokens")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"model.layers.{i}")
        self.norm.load(reader, "model.norm.weight")
        if not self.arch.tie_word_embeddings:
            self.lm_head.load(reader, "lm_head")
        else:  # the embedding may now hold GGUF blocks: the head serves from them (quant_weight.py)
            set_weight(self.lm_head, self.embed_tokens.weight)


def side_by_side(captured) -> torch.Tensor:
    """``CausalLM.forward``'s captures as [rows, captures x hidden], each row's in capture order
    (a drafter's features): one copy from the fused kernel's stacked tensor."""
    if isinstance(captured, torch.Tensor):
        return captured.transpose(0, 1).reshape(captured.shape[1], -1)
    return torch.cat(captured, dim=-1)
