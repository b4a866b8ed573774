"""Where a target checkpoint keeps its multi-token-prediction (MTP) modules, and the names
and shapes of their tensors. Two published layouts are read:

- DeepSeek-V3: config ``num_nextn_predict_layers`` = n; module i has its own
  ``model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head}`` and the
  decoder block ``model.layers.{L}.*``, L = num_hidden_layers + i; the embedding is the
  target's.
- Qwen3-Next: config ``mtp_num_hidden_layers`` = n; module i is the decoder block
  ``mtp.layers.{i}.*``; every module shares ``mtp.{pre_fc_norm_embedding,
  pre_fc_norm_hidden, fc, norm}`` (zero-centred norms, ``x * (1 + w)``) and the target's
  embedding and LM head.

The decoder block is the target family's full-attention block (Llama, Qwen3: q/k norms;
DeepSeek-V3 / Kimi-K2: MLA attention whose KV is latent rows in the target's pool; Qwen3-Next:
gated attention, whose q_proj holds each head's query and output gate, and zero-centred norms);
MoE when the block has a router, ``{mlp prefix}.gate.weight``, as DeepSeek-V3's and Qwen3-Next's
MTP blocks do (Qwen3-Next's with its sigmoid-gated shared expert). The layout is also read for
Qwen3 / Qwen3-MoE targets, whose blocks and norms are then that family's.

A checkpoint directory whose config says ``SpecrayMTPDrafter`` is specray's retired format.
"""

from __future__ import annotations

from dataclasses import dataclass

from specray.models.arch import ModelArch
from specray.models.drafters.formats import check_tensors

DEEPSEEK_V3 = "deepseek_v3"
QWEN3_NEXT = "qwen3_next"
RETIRED_MTP = "SpecrayMTPDrafter"
CONVERT_TO = ("the target checkpoint's own MTP layout: DeepSeek-V3 (config num_nextn_predict_layers; tensors "
              "model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head} plus the decoder "
              "block, L = num_hidden_layers + i) or Qwen3-Next (config mtp_num_hidden_layers; tensors "
              "mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm, layers.i})")
# Fields of the target architecture a checkpoint holding the MTP weights must share with the target.
SAME_AS_TARGET = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


@dataclass(frozen=True, slots=True)
class MTPFormat:
    layout: str  # DEEPSEEK_V3 or QWEN3_NEXT
    num_modules: int  # in the checkpoint
    arch: ModelArch  # the target's
    is_moe: tuple[bool, ...]  # per module: its block routes to experts

    def prefix(self, i: int) -> str:
        return module_prefix(self.layout, self.arch, i)


def module_prefix(layout: str, arch: ModelArch, i: int) -> str:
    """Module i's own tensors and block (DeepSeek-V3: numbered after the target's layers), or
    its decoder block (Qwen3-Next)."""
    return f"model.layers.{arch.num_layers + i}" if layout == DEEPSEEK_V3 else f"mtp.layers.{i}"


def num_mtp_modules(cfg: dict) -> tuple[str, int] | None:
    """(layout, number of modules) the config declares, or None."""
    if cfg.get("num_nextn_predict_layers"):
        return DEEPSEEK_V3, int(cfg["num_nextn_predict_layers"])
    if cfg.get("mtp_num_hidden_layers"):
        return QWEN3_NEXT, int(cfg["mtp_num_hidden_layers"])
    return None


def read_mtp_format(cfg: dict, arch: ModelArch, target: ModelArch, reader, source: str) -> MTPFormat:
    """The MTP modules of the checkpoint at ``source`` (config ``cfg``, architecture ``arch``),
    checked against the target and tensor by tensor; errors name what was looked for."""
    if RETIRED_MTP in (cfg.get("architectures") or []):
        raise ValueError(f"mtp checkpoint {source!r} is in specray's own format {RETIRED_MTP!r}, which is "
                         f"deprecated and no longer read; convert it to {CONVERT_TO}")
    found = num_mtp_modules(cfg)
    if found is None:
        raise ValueError(f"spec method 'mtp' reads the MTP modules inside the target checkpoint, and {source!r} "
                         f"has none: its config.json has neither num_nextn_predict_layers (DeepSeek-V3 layout, "
                         f"tensors model.layers.{{L}}.eh_proj ...) nor mtp_num_hidden_layers (Qwen3-Next layout, "
                         f"tensors mtp.fc ...). Use a checkpoint with MTP weights, e.g. the '<preset>-mtp' presets")
    layout, n = found
    different = [f"{f} {getattr(arch, f)} (target {getattr(target, f)})" for f in SAME_AS_TARGET
                 if getattr(arch, f) != getattr(target, f)]
    if different:
        raise ValueError(f"mtp checkpoint {source!r} is not the target's: {different}")
    moe = arch.family.moe_prefix
    fmt = MTPFormat(layout, n, target, tuple(
        bool(target.is_moe and reader.has(f"{module_prefix(layout, target, i)}.{moe}.gate.weight")) for i in range(n)))
    check_tensors(reader, expected_tensors(fmt), source)
    return fmt


def expected_tensors(fmt: MTPFormat) -> dict[str, tuple[int, ...]]:
    """Every tensor the MTP modules need, with its shape."""
    a = fmt.arch
    h = a.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    if fmt.layout == QWEN3_NEXT:
        out.update({"mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
                    "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,)})
    for i in range(fmt.num_modules):
        p = fmt.prefix(i)
        if fmt.layout == DEEPSEEK_V3:
            out.update({f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,), f"{p}.eh_proj.weight": (h, 2 * h),
                        f"{p}.shared_head.norm.weight": (h,), f"{p}.shared_head.head.weight": (a.vocab_size, h)})
        out.update(block_tensors(p, a, fmt.is_moe[i]))
    return out


def mla_tensors(prefix: str, arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """An MLA attention's tensors (DeepSeek-V3; a plain q_proj when q_lora_rank is null)."""
    m, h, heads, a = arch.mla, arch.hidden_size, arch.num_heads, f"{prefix}.self_attn"
    out = {f"{a}.kv_a_proj_with_mqa.weight": (m.latent_dim, h), f"{a}.kv_a_layernorm.weight": (m.kv_lora_rank,),
           f"{a}.kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
           f"{a}.o_proj.weight": (h, heads * m.v_head_dim)}
    if m.q_lora_rank is None:
        out[f"{a}.q_proj.weight"] = (heads * m.qk_head_dim, h)
    else:
        out.update({f"{a}.q_a_proj.weight": (m.q_lora_rank, h), f"{a}.q_a_layernorm.weight": (m.q_lora_rank,),
                    f"{a}.q_b_proj.weight": (heads * m.qk_head_dim, m.q_lora_rank)})
    return out


def block_tensors(prefix: str, arch: ModelArch, is_moe: bool) -> dict[str, tuple[int, ...]]:
    """A decoder block's tensors in Hugging Face names (dense MLP or routed experts)."""
    h, hd = arch.hidden_size, arch.head_dim
    out = {f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.post_attention_layernorm.weight": (h,)}
    if arch.mla is not None:
        out.update(mla_tensors(prefix, arch))
    else:  # a gated attention's q_proj holds each head's query and output gate (Qwen3-Next)
        q_rows = (2 if arch.family.mixer == "gated_attention" else 1) * arch.num_heads * hd
        out.update({f"{prefix}.self_attn.q_proj.weight": (q_rows, h),
                    f"{prefix}.self_attn.k_proj.weight": (arch.num_kv_heads * hd, h),
                    f"{prefix}.self_attn.v_proj.weight": (arch.num_kv_heads * hd, h),
                    f"{prefix}.self_attn.o_proj.weight": (h, arch.num_heads * hd)})
    if arch.family.has_qk_norm:
        out.update({f"{prefix}.self_attn.q_norm.weight": (hd,), f"{prefix}.self_attn.k_norm.weight": (hd,)})
    if not is_moe:
        inter = arch.intermediate_size
        out.update({f"{prefix}.mlp.gate_proj.weight": (inter, h), f"{prefix}.mlp.up_proj.weight": (inter, h),
                    f"{prefix}.mlp.down_proj.weight": (h, inter)})
        return out
    m, inter = f"{prefix}.{arch.family.moe_prefix}", arch.moe_intermediate_size
    g, u, d = arch.family.expert_names
    out[f"{m}.gate.weight"] = (arch.num_experts, h)
    if arch.router is not None:  # DeepSeekMoE: the choice bias and the shared experts
        out[f"{m}.gate.e_score_correction_bias"] = (arch.num_experts,)
        if arch.router.num_shared_experts:
            shared = inter * arch.router.num_shared_experts
            out.update({f"{m}.shared_experts.gate_proj.weight": (shared, h),
                        f"{m}.shared_experts.up_proj.weight": (shared, h),
                        f"{m}.shared_experts.down_proj.weight": (h, shared)})
    if arch.shared_expert_intermediate_size:  # Qwen3-Next: one sigmoid-gated shared expert
        shared = arch.shared_expert_intermediate_size
        out.update({f"{m}.shared_expert.gate_proj.weight": (shared, h), f"{m}.shared_expert.up_proj.weight": (shared, h),
                    f"{m}.shared_expert.down_proj.weight": (h, shared), f"{m}.shared_expert_gate.weight": (1, h)})
    for e in range(arch.num_experts):
        out.update({f"{m}.experts.{e}.{g}.weight": (inter, h), f"{m}.experts.{e}.{u}.weight": (inter, h),
                    f"{m}.experts.{e}.{d}.weight": (h, inter)})
    return out
