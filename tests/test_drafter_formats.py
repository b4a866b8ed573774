"""Drafters in their published formats, checked against the reference implementations on
tiny random checkpoints (drafter_checkpoints.py writes them): EAGLE-3 (SpecForge's and
speculators' layouts), DFlash (z-lab's and speculators' layouts), DSpark (speculators'); the
EAGLE-3 aux-layer convention; and bad input (configs that do not fit the target, missing or
mis-shaped tensors, specray's retired formats).

References (installed ``--no-deps`` by the Makefile's TEST_REFERENCES):

- DFlash: z-lab's ``dflash.model.DFlashDraftModel`` runs as is on CPU.
- EAGLE-3, DSpark, speculators' DFlash: ``speculators``' own modules (the EAGLE-3 decoder
  layer ``LlamaDecoderEagle3FirstLayer``, the DFlash layer ``Qwen3DFlashDecoderLayer``, the
  DSpark ``MarkovHead`` and ``ConfidenceHead``). Importing the ``speculators`` package runs
  its ``__init__``, which imports its training stack (openai, datasets, hs_connectors, a vLLM
  client) that a drafter does not need, so the tests load the model-definition modules alone
  from the installed package. speculators' model classes around them are training forwards
  (flex attention over anchored blocks, test-time-training masks), not an inference path, so
  what lies outside those modules (fc, norms, lm_head, d2t, the autoregressive feedback or
  the Markov chain over a block) is written out here as the published equations, and the
  layers run with transformers' KV cache.

Tolerance for draft logits: specray and the references compute the same float32 maths in a
different order (fused q/k/v, paged or tiled attention), so logits agree closely but not
bitwise (measured: at most 1.2e-7 apart on logits of standard deviation 0.18);
1e-4 relative / 1e-5 absolute leaves margin, and every wrong term tried while writing these
tests (a norm skipped, the residual taken before hidden_norm, the Markov chain not fed back)
failed them. Draft tokens must be equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import load_reference, make_checkpoint
from drafter_checkpoints import (
    PAGE,
    WRITERS,
    empty_pools,
    load,
    propose,
    speculators_module,
    target_features,
    write_dflash,
    write_dspark,
    write_eagle3,
)
from safetensors.torch import load_file, save_file

from specray.comm.context import DistContext
from specray.models.drafters.common import DraftBatch, DraftSeq, to_target_vocab
from specray.workers.worker import load_model

TOL = dict(rtol=1e-4, atol=1e-5)  # see the module docstring


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_checkpoint("llama", tmp_path_factory.mktemp("fmt") / "target", seed=3, num_hidden_layers=4)
    return path, load_model(path, DistContext.single(), "float32"), load_reference(path)


# --------------------------------------------------------------------------- EAGLE-3


def eagle3_reference(path: Path, hf_target, tokens, features, k):
    """EAGLE-3 drafting with speculators' decoder layer and the published equations."""
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    definitions = speculators_module("speculators.models.eagle3.model_definitions")
    cfg = json.loads((path / "config.json").read_text())
    layer_cfg = cfg.get("transformer_layer_config", cfg)
    prefix = "layers.0." if "transformer_layer_config" in cfg else "midlayer."
    config = LlamaConfig(**{key: layer_cfg[key] for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_theta", "max_position_embeddings")}, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    w = load_file(path / "model.safetensors")
    layer = definitions.LlamaDecoderEagle3FirstLayer(config, 0, cfg.get("norm_before_residual", False))
    layer.load_state_dict({n[len(prefix):]: t for n, t in w.items() if n.startswith(prefix)})
    layer.eval()
    rotary, cache = LlamaRotaryEmbedding(config), DynamicCache(config=config)
    embed = w.get("embed_tokens.weight", hf_target.model.embed_tokens.weight)
    norm = lambda x: hf_target.model.norm.__class__(x.shape[-1], eps=config.rms_norm_eps)  # noqa: E731
    final_norm = norm(torch.empty(config.hidden_size))
    final_norm.weight.data.copy_(w["norm.weight"])
    vocab = config.vocab_size
    target_ids = torch.arange(w["lm_head.weight"].shape[0]) + w["d2t"] if "d2t" in w else None

    def run(ids, h, start):
        x = torch.cat([F.embedding(ids, embed), h], dim=-1)[None]
        pos = torch.arange(start, start + len(ids))[None]
        g = layer(x, position_ids=pos, past_key_values=cache, use_cache=True,
                  position_embeddings=rotary(x, pos))[0]
        draft = F.linear(final_norm(g[-1:]), w["lm_head.weight"])[0]
        if target_ids is None:
            return draft, g[-1:]
        return torch.full((vocab,), float("-inf")).index_put((target_ids,), draft), g[-1:]

    with torch.no_grad():
        logits, g = run(torch.tensor(tokens[1:]), F.linear(features, w["fc.weight"]), 0)
        out = [logits]
        for j in range(1, k):
            logits, g = run(out[-1].argmax()[None], g, len(tokens) - 2 + j)
            out.append(logits)
    out = torch.stack(out)
    return out.argmax(-1).tolist(), out


@pytest.mark.parametrize("layout, draft_vocab, embed, extra", [
    ("specforge", None, False, {}),
    ("specforge", 200, False, {}),  # d2t
    ("speculators", 200, True, {"norm_before_residual": True}),
])
def test_eagle3_drafts_equal_speculators_reference(target, tmp_path, layout, draft_vocab, embed, extra):
    target_dir, model, hf = target
    path = write_eagle3(tmp_path / "e3", target_dir, layout, draft_vocab, embed, **extra)
    drafter = load("eagle3", path, model, k=4)
    assert drafter.fmt.layout == ("LlamaForCausalLMEagle3" if layout == "specforge" else "Eagle3Speculator")
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45, 200, 13, 14, 15]
    features = target_features(model, hf, tokens, drafter.feature_layers)
    drafts, logits = propose(drafter, tokens, features, 4, empty_pools(drafter, 1))
    ref_drafts, ref_logits = eagle3_reference(path, hf, tokens, features, 4)
    assert drafts == ref_drafts
    finite = torch.isfinite(ref_logits)
    assert torch.equal(finite, torch.isfinite(logits))  # d2t: the same target ids reachable
    torch.testing.assert_close(logits[finite], ref_logits[finite], **TOL)


def test_aux_layer_conventions_top_level_entering_and_nested_outputs_agree(target, tmp_path):
    target_dir, model, hf = target
    nested = write_eagle3(tmp_path / "nested", target_dir, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    top = tmp_path / "top"
    shutil.copytree(nested, top)
    cfg = json.loads((top / "config.json").read_text())
    del cfg["eagle_config"]
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]
    (top / "config.json").write_text(json.dumps(cfg))
    a, b = load("eagle3", nested, model), load("eagle3", top, model)
    assert a.feature_layers == b.feature_layers == (0, 1, 3)  # outputs of those target layers
    tokens = list(range(10, 40))
    features = target_features(model, hf, tokens, a.feature_layers)
    da, la = propose(a, tokens, features, 3, empty_pools(a, 1))
    db, lb = propose(b, tokens, features, 3, empty_pools(b, 1))
    assert da == db and torch.equal(la, lb)
    # with neither, vLLM's default: entering (2, L // 2, L - 3) = (2, 2, 1) for 4 layers -> outputs (1, 1, 0)
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (top / "config.json").write_text(json.dumps(cfg))
    assert load("eagle3", top, model).feature_layers == (1, 1, 0)


# --------------------------------------------------------------------------- DFlash


def test_dflash_drafts_equal_zlab_reference(target, tmp_path):
    from transformers import DynamicCache

    from dflash.model import DFlashDraftModel, _crop_to

    target_dir, model, hf = target
    path = write_dflash(tmp_path / "df", target_dir, block_size=8)
    drafter = load("dflash", path, model, k=7)
    ref = DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()
    assert ref.target_layer_ids == list(drafter.feature_layers) and ref.mask_token_id == drafter.mask_token_id
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45, 200, 13, 14, 15, 61]
    features = target_features(model, hf, tokens, drafter.feature_layers)
    pools, cache = empty_pools(drafter, 2), DynamicCache(config=ref.config)
    n = ref.block_size
    # two steps: the prompt's context, then 5 more verified positions (the cache keeps the context only)
    for consumed, length in ((0, 20), (19, 25)):
        seq = tokens[:length]
        drafts, logits = propose(drafter, seq, features[consumed:length - 1], 7, pools, consumed)
        with torch.no_grad():
            block = torch.tensor([[seq[-1]] + [ref.mask_token_id] * (n - 1)])
            hidden = ref(target_hidden=features[None, consumed:length - 1],
                         noise_embedding=F.embedding(block, hf.model.embed_tokens.weight),
                         position_ids=torch.arange(consumed, length - 1 + n)[None],
                         past_key_values=cache, use_cache=True)[:, 1 - n:]
            _crop_to(cache, length - 1)
            ref_logits = ref.compute_logits(hidden, hf.lm_head)[0]
        assert drafts == ref_logits.argmax(-1).tolist()
        torch.testing.assert_close(logits, ref_logits, **TOL)



@pytest.mark.parametrize("method, k", [("dflash", 3), ("dflash", 7), ("dspark", 3)])
def test_last_layer_on_the_drafted_slots_only_equals_the_whole_block(target, tmp_path, monkeypatch, method, k):
    """block_outputs runs the last layer's queries, o_proj and MLP on the drafted slots only (issue 29): the drafts
    and their logits equal the whole block's, sliced afterwards, to the bit (every op after the attention is row
    by row). A mutation check: keeping the wrong slots changes the drafts."""
    from specray.models.drafters.dflash import DFlashDrafter

    target_dir, model, hf = target
    write = write_dflash if method == "dflash" else write_dspark
    drafter = load(method, write(tmp_path / "d", target_dir, block_size=8), model, k=k)
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45]
    features = target_features(model, hf, tokens, drafter.feature_layers)
    kept = propose(drafter, tokens, features, k, empty_pools(drafter, 2))
    whole_block = DFlashDrafter.block_outputs

    def sliced_after(is_shifted):
        def block_outputs(self, batch, keep=slice(None)):
            shift = (-1 if keep.start else 1) if is_shifted else 0  # a neighbouring window of slots
            return whole_block(self, batch)[:, keep.start + shift:keep.stop + shift]
        return block_outputs
    monkeypatch.setattr(DFlashDrafter, "block_outputs", sliced_after(False))
    whole = propose(drafter, tokens, features, k, empty_pools(drafter, 2))
    assert kept[0] == whole[0]
    assert torch.equal(kept[1], whole[1])
    monkeypatch.setattr(DFlashDrafter, "block_outputs", sliced_after(True))
    assert not torch.equal(propose(drafter, tokens, features, k, empty_pools(drafter, 2))[1], kept[1])


@pytest.mark.parametrize("method, block_size", [("dflash", 8), ("dflash", 16), ("dspark", 8)])
def test_the_first_layer_projects_the_mask_row_once(target, tmp_path, monkeypatch, method, block_size):
    """The first layer's q/k/v come from two rows a sequence (the last token, one mask row) repeated over the block
    (issue 29): the drafts and their logits equal the block projected row by row, to the bit, over two steps of one
    sequence and at two sequences in one batch."""
    from specray.models.drafters.dflash import DFlashDrafter

    target_dir, model, hf = target
    write = write_dflash if method == "dflash" else write_dspark
    drafter = load(method, write(tmp_path / "d", target_dir, block_size=block_size), model, k=3)
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45]
    features = target_features(model, hf, tokens, drafter.feature_layers)
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]
    other_features = target_features(model, hf, other, drafter.feature_layers)

    def steps():
        """Drafts and logits of one sequence over two steps, then of two sequences in one batch."""
        pools = empty_pools(drafter, 2)
        first = propose(drafter, tokens[:15], features[:14], 3, pools)
        second = propose(drafter, tokens, features[14:], 3, pools, consumed=14)
        logits = []
        seqs = [DraftSeq(tokens, 0, features, [0, 1, 2, 3]), DraftSeq(other, 0, other_features, [4, 5, 6, 7])]
        drafts = drafter.propose(DraftBatch(seqs, 3, empty_pools(drafter, 2), PAGE, torch.device("cpu")),
                                 lambda row_logits, j: logits.append(row_logits.clone()) or row_logits.argmax(-1))
        return [first, second, (drafts.tolist(), torch.stack(logits))]
    once = steps()
    layer = DFlashDrafter._layer
    monkeypatch.setattr(DFlashDrafter, "_layer", staticmethod(lambda *a, is_first=False, **kw: layer(*a, **kw)))
    for (once_drafts, once_logits), (row_drafts, row_logits) in zip(once, steps(), strict=True):
        assert once_drafts == row_drafts
        assert torch.equal(once_logits, row_logits)


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_the_fast_path_proposes_the_torch_paths_drafts(target, tmp_path, monkeypatch, method):
    """The drafter's C kernels (small_gemm, the block's q/k norms and RoPE, its attention over pool and block; issue
    29) against the same drafter on torch's ops alone (no kernels, as on a machine without a compiler): the same
    drafts over two steps, logits within TOL (different summation orders)."""
    from specray.models import cpu_kernels

    target_dir, model, hf = target
    drafter = load(method, WRITERS[method](tmp_path / "d", target_dir), model, k=4)
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45, 200, 13, 14]
    features = target_features(model, hf, tokens, drafter.feature_layers)

    def two_steps():
        pools = empty_pools(drafter, drafter.kv_layout.num_layers)
        first = propose(drafter, tokens[:18], features[:17], 4, pools)
        return first, propose(drafter, tokens, features[17:], 4, pools, consumed=17)
    fast = two_steps()
    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: None)
    slow = two_steps()
    for (fast_drafts, fast_logits), (slow_drafts, slow_logits) in zip(fast, slow):
        assert fast_drafts == slow_drafts
        torch.testing.assert_close(fast_logits, slow_logits, **TOL)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3s_fused_layer_proposes_the_module_paths_drafts(target, tmp_path, monkeypatch, norm_before_residual):
    """EAGLE-3's layer in fused_layer.c's two blocks (its 2H-wide q/k/v input normed and laid out in C; issue 29)
    against the same layer module by module on the same kernels (SPECRAY_CPU_FUSED_LAYERS=0): the same drafts and
    K/V over two steps, logits within TOL (the fused MLP's silu is specray_silu_mul's, not torch's), and the fused
    blocks taken wherever the rows allow: every draft position and the second step's catch-up (the first step's
    prompt goes to SDPA)."""
    from specray.models.drafters.eagle3 import Eagle3Drafter

    target_dir, model, hf = target
    path = write_eagle3(tmp_path / "d", target_dir, "speculators", 200, norm_before_residual=norm_before_residual)
    drafter = load("eagle3", path, model, k=4)
    assert drafter.fmt.norm_before_residual is norm_before_residual
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45, 200, 13, 14]
    features = target_features(model, hf, tokens, drafter.feature_layers)
    rows, real = [], Eagle3Drafter._fused_layer
    monkeypatch.setattr(Eagle3Drafter, "_fused_layer",
                        lambda self, kernels, emb, *a: rows.append(emb.shape[0]) or real(self, kernels, emb, *a))

    def two_steps():
        pools = empty_pools(drafter, 1)
        first = propose(drafter, tokens[:18], features[:17], 4, pools)
        return first, propose(drafter, tokens, features[17:], 4, pools, consumed=17), pools
    fused = two_steps()
    assert rows == [1, 1, 1, 5, 1, 1, 1]
    monkeypatch.setenv("SPECRAY_CPU_FUSED_LAYERS", "0")
    module = two_steps()
    assert len(rows) == 7  # the module path took no fused block
    for (fused_drafts, fused_logits), (module_drafts, module_logits) in zip(fused[:2], module[:2]):
        assert fused_drafts == module_drafts
        torch.testing.assert_close(fused_logits, module_logits, **TOL)
    torch.testing.assert_close(fused[2][0], module[2][0], **TOL)


# --------------------------------------------------------------------------- DSpark

LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "num_hidden_layers")


def dspark_reference(path: Path, hf_target, tokens, features, k):
    """DSpark (or speculators' DFlash: no heads) drafting with speculators' DFlash layers and DSpark heads (the published
    equations around them: fc, hidden_norm, norm, lm_head or the verifier's, d2t, and the
    Markov chain over the block's slots, each biased by the token before it)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

    layer_defs = speculators_module("speculators.models.dflash.model_definitions")
    heads = speculators_module("speculators.models.dspark.model_definitions")
    cfg = json.loads((path / "config.json").read_text())
    config = Qwen3Config(**{key: cfg["transformer_layer_config"][key] for key in LAYER_KEYS})
    config._attn_implementation = "sdpa"
    w = load_file(path / "model.safetensors")

    def part(prefix):
        return {n[len(prefix):]: t for n, t in w.items() if n.startswith(prefix)}

    def rms(name):
        norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norm.weight.data.copy_(w[name])
        return norm

    layers = [layer_defs.Qwen3DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
    for i, layer in enumerate(layers):
        layer.load_state_dict(part(f"layers.{i}."))
    markov = confidence = None
    if cfg.get("markov_rank"):
        markov = heads.MarkovHead(verifier_vocab_size=config.vocab_size, draft_vocab_size=cfg["draft_vocab_size"],
                                  markov_rank=cfg["markov_rank"], hidden_size=config.hidden_size,
                                  head_type=cfg["markov_head_type"])
        markov.load_state_dict(part("markov_head."))
        confidence = heads.ConfidenceHead(config.hidden_size + cfg["markov_rank"])
        confidence.load_state_dict(part("confidence_head."))
    n, length = cfg["block_size"], len(tokens)
    lm_head = w.get("lm_head.weight", hf_target.lm_head.weight)
    target_ids = torch.arange(lm_head.shape[0]) + w["d2t"] if "d2t" in w else None
    with torch.no_grad():
        context = rms("hidden_norm.weight")(F.linear(features, w["fc.weight"]))[None]
        block = torch.tensor([[tokens[-1]] + [cfg["mask_token_id"]] * (n - 1)])
        x = F.embedding(block, hf_target.model.embed_tokens.weight)
        positions = torch.arange(0, length - 1 + n)[None]
        embeddings = Qwen3RotaryEmbedding(config)(x, positions)
        for layer in layers:
            x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_embeddings=embeddings)
        first = 0 if cfg["sample_from_anchor"] else 1  # with sample_from_anchor, slot j drafts token L + j
        normed = rms("norm.weight")(x)[0, first:first + k]
        prev, logits, conf = torch.tensor([tokens[-1]]), [], []
        for j in range(k):
            o = normed[j:j + 1]
            draft = F.linear(o, lm_head)
            if markov is not None:
                draft = draft + markov.block_bias(prev_token_ids=prev[None], hidden_states=o[None])[0]
                conf.append(torch.sigmoid(confidence(torch.cat([o, markov.prev_embeddings(prev)], dim=-1)))[0])
            full = draft[0] if target_ids is None else torch.full((config.vocab_size,), float("-inf")).index_put(
                (target_ids,), draft[0])
            logits.append(full)
            prev = full.argmax()[None]
    logits = torch.stack(logits)
    return logits.argmax(-1).tolist(), logits, normed, torch.stack(conf) if conf else None


@pytest.mark.parametrize("draft_vocab, head_type", [(None, "vanilla"), (200, "gated")])
def test_dspark_drafts_equal_speculators_reference(target, tmp_path, draft_vocab, head_type):
    target_dir, model, hf = target
    path = write_dspark(tmp_path / "ds", target_dir, draft_vocab_size=draft_vocab, markov_head_type=head_type)
    drafter = load("dspark", path, model, k=8)
    assert drafter.feature_layers == (0, 2, 3)  # aux_hidden_state_layer_ids [1, 3, 4]: the layers entered
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45]
    features = target_features(model, hf, tokens, drafter.feature_layers)
    drafts, logits = propose(drafter, tokens, features, 8, empty_pools(drafter, 2))
    ref_drafts, ref_logits, normed, ref_conf = dspark_reference(path, hf, tokens, features, 8)
    assert drafts == ref_drafts
    finite = torch.isfinite(ref_logits)
    assert torch.equal(finite, torch.isfinite(logits))
    torch.testing.assert_close(logits[finite], ref_logits[finite], **TOL)
    prev = torch.tensor([tokens[-1]] + drafts[:-1])
    torch.testing.assert_close(drafter.confidence(prev, normed), ref_conf, **TOL)


def test_speculators_dflash_layout_drafts_equal_speculators_reference(target, tmp_path):
    target_dir, model, hf = target
    path = write_dspark(tmp_path / "df", target_dir, draft_vocab_size=200, algorithm="dflash")
    drafter = load("dflash", path, model, k=7)
    assert drafter.feature_layers == (0, 2, 3) and drafter.fmt.max_drafts == 7  # block 8, the anchor drafts nothing
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45]
    features = target_features(model, hf, tokens, drafter.feature_layers)
    drafts, logits = propose(drafter, tokens, features, 7, empty_pools(drafter, 2))
    ref_drafts, ref_logits, _, _ = dspark_reference(path, hf, tokens, features, 7)
    assert drafts == ref_drafts
    finite = torch.isfinite(ref_logits)
    torch.testing.assert_close(logits[finite], ref_logits[finite], **TOL)


# --------------------------------------------------------------------------- bad input


def _edit_config(path: Path, **changes) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _edit_tensors(path: Path, drop=(), replace=None) -> Path:
    w = load_file(path / "model.safetensors")
    w = {n: t for n, t in w.items() if n not in drop}
    w.update(replace or {})
    save_file(w, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("make, edit, error", [
    ("eagle3", dict(target_hidden_size=32), "target hidden states of size 32, but the target's hidden_size is 64"),
    ("eagle3", dict(hidden_size=32), "hidden_size 32 and no embed_tokens: it would embed with the target's, of "
                                     "width 64"),
    ("eagle3", dict(vocab_size=256), "vocab_size 256 .* but the target has 384"),
    ("eagle3", dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}),
     r"eagle_config.eagle_aux_hidden_state_layer_ids \[0, 1, 4\] name target layer outputs \[4\], outside"),
    ("eagle3", dict(eagle_aux_hidden_state_layer_ids=[0, 2, 3], eagle_config={}),
     r"eagle_aux_hidden_state_layer_ids \[0, 2, 3\] name target layer outputs \[-1\]"),
    ("eagle3", dict(eagle_aux_hidden_state_layer_ids=[1, 2, 3]), "disagree"),
    ("dflash", dict(hidden_size=32), "hidden_size 32 but the target has 64"),
    ("dflash", dict(dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 9]}),
     r"target_layer_ids \[9\] are outside the target's 4 layers"),
    ("dflash", dict(dflash_config={"mask_token_id": 384, "target_layer_ids": [0]}), r"mask_token_id \(384\)"),
    ("dspark", dict(aux_hidden_state_layer_ids=[0, 2, 3]), r"aux_hidden_state_layer_ids \[0\] \(layers entered\) must "
                                                         r"be in \[1, 4\]"),
    ("dspark", dict(markov_head_type="rnn"), "markov_head_type 'rnn' is not supported yet"),
    ("dspark", dict(block_size=2), r"num_draft_tokens \(3\) must be <= block_size \(2\)"),
    ("eagle3", dict(architectures=["SpecrayEagle3Drafter"]), "deprecated .* convert it to EAGLE-3 as SpecForge"),
    ("dflash", dict(architectures=["SpecrayDFlashDrafter"]), "deprecated .* convert it to DFlash as z-lab"),
])
def test_config_that_does_not_fit_the_target_is_rejected(target, tmp_path, make, edit, error):
    target_dir, model, _ = target
    path = WRITERS[make](tmp_path / make, target_dir)
    with pytest.raises(ValueError, match=error):
        load(make, _edit_config(path, **edit), model)


def test_draft_vocabulary_without_d2t_is_rejected(target, tmp_path):
    target_dir, model, _ = target
    path = _edit_tensors(write_eagle3(tmp_path / "e3", target_dir, draft_vocab=200), drop=("d2t",))
    with pytest.raises(ValueError, match="drafts over 200 tokens but the target has 384 and the checkpoint has no d2t"):
        load("eagle3", path, model)


@pytest.mark.parametrize("make, drop, replace, error", [
    ("eagle3", ("midlayer.hidden_norm.weight",), None, r"missing \['midlayer.hidden_norm.weight'\]"),
    ("eagle3", (), {"fc.weight": torch.zeros(64, 128)}, r"mis-shaped \['fc.weight \[64, 128\] \(expected \[64, 192\]\)'\]"),
    ("dflash", ("layers.1.self_attn.k_norm.weight",), None, r"missing \['layers.1.self_attn.k_norm.weight'\]"),
    ("dflash", (), {"layers.0.self_attn.q_proj.weight": torch.zeros(64, 128)},
     r"layers.0.self_attn.q_proj.weight \[64, 128\] \(expected \[64, 64\]\)"),
    ("dspark", ("markov_head.markov_w2.weight",), None, r"missing \['markov_head.markov_w2.weight'\]"),
])
def test_missing_or_misshaped_tensors_are_named(target, tmp_path, make, drop, replace, error):
    target_dir, model, _ = target
    path = WRITERS[make](tmp_path / make, target_dir)
    with pytest.raises(ValueError, match=error):
        load(make, _edit_tensors(path, drop, replace), model)


def test_a_checkpoint_of_the_other_method_is_rejected(target, tmp_path):
    target_dir, model, _ = target
    path = write_dflash(tmp_path / "df", target_dir)
    with pytest.raises(ValueError, match=r"is a DFlashDraftModel checkpoint \(a dflash drafter\), but spec method "
                                         r"'eagle3' needs one of \['Eagle3Speculator', 'LlamaForCausalLMEagle3'\]"):
        load("eagle3", path, model)


@pytest.mark.parametrize("method, make, edit, error", [
    ("eagle3", "eagle3", dict(target_hidden_size=32), "target hidden states of size 32"),
    ("eagle3", "eagle3", dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}), r"outputs \[4\], outside"),
    ("dflash", "dflash", dict(hidden_size=32), "hidden_size 32 but the target has 64"),
    ("dspark", "dspark", dict(block_size=2), r"num_draft_tokens \(3\) must be <= block_size \(2\)"),
    ("eagle3", "dflash", {}, "is a DFlashDraftModel checkpoint"),
    ("mtp", None, {}, "has none: its config.json has neither num_nextn_predict_layers"),
    ("draft_model", None, dict(vocab_size=256), "vocab_size 256 but the target has 384"),
])
def test_the_driver_rejects_a_drafter_before_any_rank_starts(target, tmp_path, monkeypatch, method, make, edit, error):
    """A drafter that cannot fit the target fails on the driver from its config.json, before
    the ranks start and load the target (here: starting them is an error of its own)."""
    from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SpecConfig
    from specray.launch import mp

    def no_ranks(*args, **kwargs):
        raise AssertionError("the ranks were started for a drafter the driver could have rejected")

    monkeypatch.setattr(mp, "MPEngine", no_ranks)
    target_dir = target[0]
    if make is not None:
        draft = _edit_config(WRITERS[make](tmp_path / make, target_dir), **edit)
    elif method == "draft_model":
        draft = _edit_config(Path(shutil.copytree(target_dir, tmp_path / "draft")), **edit)
    else:
        draft = None  # mtp reads the target's own checkpoint, which has no MTP modules
    spec = SpecConfig(method=method, num_draft_tokens=3, draft_model=None if draft is None else str(draft))
    config = EngineConfig(model=str(target_dir), spec=spec, kv=KVConfig(capacity_tokens=1024),
                          parallel=ParallelConfig(tp_size=2, launcher="mp"))
    with pytest.raises(ValueError, match=error):
        LLM(config)


def test_the_draft_vocabulary_head_is_the_full_head_through_d2t():
    # a draft-vocabulary head (d2t: draft id i is target id i + d2t[i]) chooses what a head over
    # the target's whole vocabulary chooses when the tokens outside the draft vocabulary can never
    # be drafted: the same greedy drafts, the same sampling distribution, nothing else reachable
    gen = torch.Generator().manual_seed(0)
    vocab, draft_vocab = 50, 12
    target_ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    draft_logits = torch.randn(6, draft_vocab, generator=gen)
    full = to_target_vocab(draft_logits, target_ids, vocab)
    assert torch.equal(full.argmax(-1), target_ids[draft_logits.argmax(-1)])
    probs = full.softmax(-1)
    # the same terms, summed over 50 lanes with zeros instead of 12: equal up to the order of the sum
    torch.testing.assert_close(probs[:, target_ids], draft_logits.softmax(-1), rtol=1e-6, atol=0)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[target_ids] = False
    assert (probs[:, outside] == 0).all() and torch.isinf(full[:, outside]).all()
    assert to_target_vocab(draft_logits, None, draft_vocab) is draft_logits  # no d2t: already the target's
