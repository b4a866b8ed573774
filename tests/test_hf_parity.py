"""specray against Hugging Face transformers on tiny random checkpoints (float32 CPU)."""

from __future__ import annotations

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, prefill_logits, reference_greedy
from specray import LLM, EngineConfig, KVConfig, SamplingParams

PROMPT_LENS = (3, 41, 97, 200)  # end mid-page for every page size tested
NEW_TOKENS = 72  # 200 + 72 crosses two 128-token page boundaries
FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral")


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tmp_path_factory):
    """A checkpoint, its prompts and transformers' greedy continuation of each."""
    directory = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    reference = load_reference(directory)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    return directory, prompts, expected, reference


@pytest.mark.parametrize("tokens_per_block", [16, 32, 64, 128])
def test_greedy_matches_transformers(family_case, tokens_per_block):
    directory, prompts, expected, _ = family_case
    config = EngineConfig(model=str(directory), kv=KVConfig(tokens_per_block=tokens_per_block, capacity_tokens=4096))
    with LLM(config) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == expected


def test_greedy_matches_transformers_on_torch_ops_only(family_case, monkeypatch):
    # where specray's CPU kernels cannot be built, every layer runs on torch ops
    from specray.models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: None)
    directory, prompts, expected, _ = family_case
    config = EngineConfig(model=str(directory), kv=KVConfig(tokens_per_block=32, capacity_tokens=4096))
    with LLM(config) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == expected


def test_logits_close_to_transformers(family_case):
    # Tolerance: both sides are float32, but specray fuses q/k/v and gate/up into one matmul,
    # runs its own CPU kernels (small-row GEMM, RMSNorm, attention over pages) and sums MoE
    # experts with index_add, so each op may round differently by a few ulp; through two
    # layers that stays far below 1e-4 on logits of order 0.1-1, while any real bug (a wrong
    # rotation, mask or shard) moves them by > 1e-2.
    directory, prompts, _, reference = family_case
    prompt = prompts[2]
    ours = prefill_logits(directory, prompt)
    with torch.inference_mode():
        theirs = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_sharded_checkpoint_with_index(tmp_path):
    """A checkpoint split over several safetensors files with an index loads identically."""
    import transformers

    single = make_checkpoint("llama", tmp_path / "single")
    reference = load_reference(single)
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    prompt = list(range(5, 30))
    with LLM(EngineConfig(model=str(tmp_path / "sharded"), kv=KVConfig(capacity_tokens=512))) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert out.token_ids == reference_greedy(reference, prompt, 24)
    assert transformers.__version__ == "5.24.0"
