"""Tiny Hugging Face checkpoints built offline (random weights, save_pretrained)."""

from __future__ import annotations

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


def make_checkpoint(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(directory)
    return Path(directory)


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
