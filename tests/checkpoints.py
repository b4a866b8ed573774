"""Tiny Hugging Face checkpoints built offline (random weights, save_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=None,
              bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}
# DeepSeek-V3: YaRN with rope_interleave, q_lora, n_group 4 / topk_group 2, a non-zero score-correction bias
# (set in make_checkpoint), one dense layer first; num_key_value_heads = heads and head_dim = qk_rope_head_dim,
# as DeepSeek-V3 configs have them
_DEEPSEEK = dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=8, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, num_experts_per_tok=2,
                 routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, rope_interleave=True)
FAMILIES["deepseek_v3"] = ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
    _DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                         original_max_position_embeddings=256, beta_fast=32, beta_slow=1)))
# Kimi-K2's shape: a plain q_proj (q_lora_rank null), one expert group, default RoPE, no rope interleave
FAMILIES["kimi_k2"] = ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
    _DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1, rope_interleave=False,
    rope_parameters=dict(rope_type="default", rope_theta=50000.0)))
# Qwen3-Next: explicit layer_types (linear, full, linear, full), the first layer dense, the others MoE with
# the shared expert, 2 key heads x 2 value heads each in the linear layers, partial RoPE (a quarter of head_dim)
FAMILIES["qwen3_next"] = ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=True))
# Kimi Linear: layer types given explicitly in linear_attn_config (KimiLinearConfig's default for 4 layers is
# all KDA, which transformers cannot run): KDA, KDA, MLA without RoPE, KDA; 4 KDA heads of 16; the first layer
# dense, the others DeepSeek-routed MoE (8 experts, one group, a shared expert); a plain q_proj as Kimi Linear has
FAMILIES["kimi_linear"] = ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
    num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, q_lora_rank=None, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=32, n_group=1, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
    linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 4],
                            full_attn_layers=[3])))


def make_checkpoint(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():  # DeepSeek-V3's router bias: zeros at init, not in a checkpoint
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)
    if family == "qwen3_next":
        _strengthen_linear_layers(model, gen)
    if family == "kimi_linear":
        _strengthen_kda_layers(model, gen)
    model.save_pretrained(directory)
    return Path(directory)


def _strengthen_linear_layers(model, gen: torch.Generator) -> None:
    """Qwen3-Next at transformers' init barely reads its linear layers' state: the layers' outputs
    are small beside the residual stream and most heads decay their state to nothing within a
    token (A up to 16), so a lost or stale state would not change a greedy token. Long memory
    (A in [0.01, 0.5]) and larger projections make the state matter; the zero-centred norms
    (w = 0 at init) and the gated norm (1) are moved off their init so a wrong offset shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.01, 0.5, generator=gen).log())
            elif name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.out_proj.weight")):
                param.mul_(5.0)


def _strengthen_kda_layers(model, gen: torch.Generator) -> None:
    """Kimi Linear at transformers' init forgets fast (A up to 16) and its KDA outputs are small
    beside the residual stream (its short convs start at N(0, 0.02): values of ~0.03), as
    Qwen3-Next's (above): long memory (A in [0.01, 0.5]), larger q/k/v, conv and output weights in
    the KDA layers, and norms moved off 1 make a lost state, a wrong window or a wrong norm change
    greedy tokens."""
    kda = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    scaled = tuple(f"layers.{i}.self_attn.{n}_proj.weight" for i in kda for n in ("q", "k", "v", "o"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.01, 0.5, generator=gen).log())
            elif name.endswith(scaled):
                param.mul_(5.0)
            elif name.endswith("self_attn.conv1d.weight"):
                param.mul_(10.0)


def load_reference(directory: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prefill_logits(path, prompt: list[int]) -> torch.Tensor:
    """specray's logits for every position of ``prompt`` (one rank, float32, 16-token pages):
    the model run directly on fresh pools, for logits comparisons with transformers."""
    from specray.comm.context import DistContext
    from specray.models.attention import AttentionMetadata
    from specray.models.loader import load_model

    model = load_model(path, DistContext.single("cpu"), "float32")
    block = 16
    num_blocks = -(-len(prompt) // block)
    pools = [torch.zeros(num_blocks, 2, model.num_local_kv_heads, block, model.arch.head_dim)
             for _ in range(model.arch.num_layers)]
    positions = torch.arange(len(prompt))
    meta = AttentionMetadata(slot_mapping=positions, block_tables=torch.arange(num_blocks)[None, :],
                             context_lens=torch.tensor([len(prompt)]), query_lens=[len(prompt)])
    with torch.inference_mode():
        return model.logits(model(torch.tensor(prompt), positions, pools, meta))


def make_qwen3_next_with_mtp(directory: Path, seed: int = 0, embedding_scale: float = 30.0) -> Path:
    """A Qwen3-Next checkpoint (make_checkpoint) with one MTP module in its own layout (``mtp.*``)
    whose drafts the target often accepts, so that a verify commits every acceptance count.

    A random MTP module's drafts are never accepted. Here the embedding is scaled up so that the
    residual stream leans on the current token (the layers' outputs are normed-input projections
    that do not grow with it), and the module reads that token's embedding alone (``mtp.fc`` =
    [I | 0], ``mtp.norm`` = the target's final norm): its logits approximate the target's next
    ones. At 30x (measured on the test prompts) acceptance lengths are 2.2-3.1 of 4 at k = 3,
    and a verify that skips the state commit still changes the greedy tokens: the linear layers'
    state still matters."""
    from safetensors.torch import load_file

    from specray.models.drafter_presets import mtp_checkpoint
    from specray.models.presets import write_checkpoint

    make_checkpoint("qwen3_next", directory, seed)
    cfg = json.loads((directory / "config.json").read_text())
    weights = load_file(directory / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * embedding_scale
    cfg, weights = mtp_checkpoint(cfg, weights, seed)
    h = cfg["hidden_size"]
    weights.update({"mtp.fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
                    "mtp.norm.weight": weights["model.norm.weight"].clone(),
                    "mtp.pre_fc_norm_embedding.weight": torch.zeros(h)})  # zero-centred: a scale of 1
    write_checkpoint(directory, cfg, weights)
    return Path(directory)
