"""The gated delta rule (specray/models/gated_delta.py) against transformers' torch fallbacks
(Qwen3-Next's `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`), float32 on
random inputs, and the per-position states a verify step commits."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from specray.models.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule

# 2 q/k heads serving 4 value heads (the grouped layout), 37 tokens: two full 16-token chunks and a short one
BATCH, SEQ, K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 37, 2, 4, 16, 8


def _inputs(seed: int, seq: int = SEQ):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seq, K_HEADS, K_DIM, generator=gen)
    k = torch.randn(BATCH, seq, K_HEADS, K_DIM, generator=gen)
    v = torch.randn(BATCH, seq, V_HEADS, V_DIM, generator=gen)
    # Qwen3-Next: g = -exp(A_log) * softplus(a + dt_bias) <= 0; logsigmoid gives the same range
    g = torch.nn.functional.logsigmoid(torch.randn(BATCH, seq, V_HEADS, generator=gen))
    beta = torch.rand(BATCH, seq, V_HEADS, generator=gen)  # sigmoid(b) in (0, 1)
    state = torch.randn(BATCH, V_HEADS, K_DIM, V_DIM, generator=gen)
    return (q, k, v, g, beta), state


# The chunked rule reorders the sums (a triangular solve and matmuls instead of a loop), so the
# two implementations agree to float32 rounding, not bitwise: with L2-normalised q and k (as
# Qwen3-Next runs) outputs and states are O(1) and differ here by < 1e-7; 1e-5 leaves room for
# another BLAS's summation order. Unnormalised inputs grow to O(30): the same relative bound.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("with_state", [True, False])
def test_chunked_rule_matches_transformers(l2, with_state):
    args, state = _inputs(1)
    state = state if with_state else None
    out, final = chunk_gated_delta_rule(*args, initial_state=state, chunk_size=16, l2_normalize_qk=l2)
    ref_out, ref_final = hf.torch_chunk_gated_delta_rule(*args, chunk_size=16, initial_state=state,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


@pytest.mark.parametrize("l2", [True, False])
def test_recurrent_rule_matches_transformers(l2):
    # The same per-token updates in the same order: equal here to the last bit, but the element
    # order of a reduction is not a contract, so the check keeps a float32 tolerance.
    args, state = _inputs(2)
    out, final = recurrent_gated_delta_rule(*args, initial_state=state, l2_normalize_qk=l2)
    ref_out, ref_final = hf.torch_recurrent_gated_delta_rule(*args, initial_state=state, output_final_state=True,
                                                             use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final, ref_final, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_and_recurrent_rules_agree(chunk_size):
    args, state = _inputs(3)
    out, final = chunk_gated_delta_rule(*args, initial_state=state, chunk_size=chunk_size, l2_normalize_qk=True)
    ref_out, ref_final = recurrent_gated_delta_rule(*args, initial_state=state, l2_normalize_qk=True)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


def test_prefill_by_chunks_then_decode_by_steps_equals_one_pass():
    # how a model runs: the chunked rule over the prompt, then the recurrent rule token by token
    # from the state it left (one rounding-level difference in the handed-over state: TOL)
    args, _ = _inputs(4, seq=50)
    prompt = [x[:, :40] for x in args]
    _, state = chunk_gated_delta_rule(*prompt, chunk_size=16, l2_normalize_qk=True)
    outs = []
    for t in range(40, 50):
        out, state = recurrent_gated_delta_rule(*(x[:, t:t + 1] for x in args), initial_state=state,
                                                l2_normalize_qk=True)
        outs.append(out)
    ref_out, ref_state = recurrent_gated_delta_rule(*args, l2_normalize_qk=True)
    torch.testing.assert_close(torch.cat(outs, dim=1), ref_out[:, 40:], **TOL)
    torch.testing.assert_close(state, ref_state, **TOL)


@pytest.mark.parametrize("num_rows", [1, 4, 8])  # verify rows: 1 + k for k = 0, 3, 7
def test_state_after_every_position_equals_the_rule_on_that_prefix(num_rows):
    # A verify of num_rows positions from a committed state: state j must be exactly the state
    # after tokens 0..j (what committing j accepted drafts keeps). The same ops in the same order,
    # so equal to the bit; a state taken one position early or late would differ.
    args, committed = _inputs(5, seq=num_rows)
    out, states = recurrent_gated_delta_rule(*args, initial_state=committed, l2_normalize_qk=True,
                                             return_all_states=True)
    assert states.shape == (BATCH, num_rows, V_HEADS, K_DIM, V_DIM)
    for j in range(num_rows):
        prefix_out, prefix_state = recurrent_gated_delta_rule(*(x[:, :j + 1] for x in args), initial_state=committed,
                                                              l2_normalize_qk=True)
        assert torch.equal(states[:, j], prefix_state), f"state {j} is not the state after {j + 1} tokens"
        assert torch.equal(out[:, :j + 1], prefix_out)
    if num_rows > 1:
        assert not torch.equal(states[:, 0], states[:, 1])  # the check can tell neighbouring positions apart
    _, final = recurrent_gated_delta_rule(*args, initial_state=committed, l2_normalize_qk=True)
    assert torch.equal(states[:, -1], final)


def test_bad_shapes_are_named():
    args, state = _inputs(6)
    with pytest.raises(ValueError, match=r"initial_state has shape \(2, 4, 16, 4\), the inputs need \(2, 4, 16, 8\)"):
        recurrent_gated_delta_rule(*args, initial_state=state[..., :4])
    q, k, v, g, beta = args
    with pytest.raises(ValueError, match=r"num_v_heads \(3\) must be a multiple of num_k_heads \(2\)"):
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match=r"chunk_size \(0\) must be >= 1"):
        chunk_gated_delta_rule(*args, chunk_size=0)
