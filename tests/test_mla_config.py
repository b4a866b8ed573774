"""DeepSeek-V3 / Kimi-K2 configs: the architecture record, and bad input refused with a clear
error naming the value and the rule, before any rank starts."""

from __future__ import annotations

import json
import math

import pytest

from specray import LLM, EngineConfig, KVConfig, ParallelConfig
from specray.models.arch import arch_from_hf_config
from test_geometry_mla import _deepseek_cfg


def test_deepseek_v3_record():
    a = arch_from_hf_config(_deepseek_cfg())
    assert (a.head_dim, a.rope_dim, a.num_kv_heads) == (192, 64, 128)  # config head_dim 64 is qk_rope_head_dim
    assert a.moe_layers == tuple(range(3, 61)) and a.mixers == ("mla",) * 61
    assert (a.mla.q_lora_rank, a.mla.kv_lora_rank, a.mla.latent_dim) == (1536, 512, 576)
    assert (a.router.n_group, a.router.topk_group, a.router.routed_scaling_factor, a.router.num_shared_experts) == \
        (8, 4, 2.5, 1)
    assert a.yarn.attention_factor == 1.0  # mscale == mscale_all_dim
    assert a.yarn.softmax_factor == pytest.approx((0.1 * 1.0 * math.log(40) + 1) ** 2)


def test_kimi_k2_record():
    a = arch_from_hf_config(_deepseek_cfg(q_lora_rank=None, n_group=1, topk_group=1, n_routed_experts=384))
    assert a.mla.q_lora_rank is None and a.router.n_group == 1 and a.num_experts == 384


BAD = [
    (dict(n_routed_experts=250), r"n_routed_experts \(250\) must be divisible by n_group \(8\)"),
    (dict(qk_rope_head_dim=63), r"qk_rope_head_dim \(63\) must be a positive even number"),
    (dict(topk_group=9), r"topk_group \(9\) must be between 1 and n_group \(8\)"),
    (dict(num_experts_per_tok=200), r"num_experts_per_tok \(200\) must be between 1 and the experts of the "
                                    r"topk_group \(4\) groups a token may use \(128\)"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0)),
     r"rope_parameters \(rope_type 'yarn'\).*factor.*original_max_position_embeddings"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1.0)), r"rope_type 'longrope' is not supported"),
    (dict(first_k_dense_replace=62), r"first_k_dense_replace \(62\) must be between 0 and num_hidden_layers \(61\)"),
]


@pytest.mark.parametrize("overrides, message", BAD)
def test_bad_config_is_a_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(_deepseek_cfg(**overrides), source="config.json")


@pytest.mark.parametrize("key", ["kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "n_group"])
def test_missing_key_is_named(key):
    cfg = _deepseek_cfg()
    del cfg[key]
    with pytest.raises(ValueError, match=key):
        arch_from_hf_config(cfg, source="config.json")


def _write(tmp_path, **overrides):
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 intermediate_size=64, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                 moe_intermediate_size=16, first_k_dense_replace=1)
    cfg = _deepseek_cfg(**{**small, **overrides})
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights: nothing may get as far as loading
    return str(tmp_path)


@pytest.mark.parametrize("overrides, tp, moe_ep, message", [
    (dict(n_routed_experts=6, n_group=2), 4, 4, r"moe_ep_size \(4\) must divide the number of experts \(6\)"),
    ({}, 3, 3, r"tp_size \(3\) must divide the attention heads \(4\)"),
    (dict(n_routed_experts=6, n_group=4), 2, 2, r"n_routed_experts \(6\) must be divisible by n_group \(4\)"),
])
def test_mapping_errors_come_before_any_rank(tmp_path, overrides, tp, moe_ep, message):
    # the checkpoint has a config.json and no weights: an error from a rank would name the
    # missing safetensors, so each rule here is checked on the driver before any rank starts
    model = _write(tmp_path, **overrides)
    parallel = ParallelConfig(tp_size=tp, moe_tp_size=1, moe_ep_size=moe_ep, launcher="mp")
    with pytest.raises(ValueError, match=message):
        LLM(EngineConfig(model=model, kv=KVConfig(capacity_tokens=64), parallel=parallel))


def test_grouped_topk_keeps_only_the_best_groups():
    # 8 experts in 4 groups of 2; group scores (top-2 sums): g0 0.3, g1 1.7, g2 1.1, g3 0.9 -> g1, g2 kept
    import torch

    from specray.models.moe import grouped_topk

    scores = torch.tensor([[0.1, 0.2, 0.9, 0.8, 0.5, 0.6, 0.95, -0.05]])
    bias = torch.zeros(8)
    assert sorted(grouped_topk(scores, bias, 4, 2, 2)[0].tolist()) == [2, 3]  # expert 6 (0.95) is in group 3
    assert sorted(grouped_topk(scores, bias, 4, 4, 2)[0].tolist()) == [2, 6]  # all groups kept
    bias[5] = 0.5  # the bias moves the choice: group 2 now sums 1.6 and expert 5 scores 1.1
    assert sorted(grouped_topk(scores, bias, 4, 2, 2)[0].tolist()) == [2, 5]
