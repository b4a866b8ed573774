"""``specray train-drafter`` (specray/training/): the pure parts with literals; bad input; and
the smoke runs on a tiny target: the loss falls, the written drafter loads in specray, is
lossless, accepts more on its training text than a random drafter, and loads in the
reference implementations (z-lab's DFlash; speculators' EAGLE-3 layer, via
test_drafter_formats' reference)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from checkpoints import make_checkpoint

from specray.cli import main
from specray.config import EngineConfig, SamplingParams, SpecConfig
from specray.llm import LLM
from specray.models.drafter_presets import write_drafter_for
from specray.training.data import check_not_evaluation_set, split
from specray.training.eagle3_trainee import draft_vocabulary, teacher_forced_acceptance
from specray.training.loop import LOG_FILE, PLOT_FILE, STATE_FILE, train
from specray.training.recipe import TrainConfig, default_aux_layers, lr_at, threads_to_use

# ------------------------------------------------------------------ pure parts


def test_draft_vocabulary_keeps_the_most_frequent_ids_sorted_ties_to_the_lower_id():
    counts = torch.tensor([5, 0, 9, 5, 1])
    assert draft_vocabulary(counts, 2).tolist() == [0, 2]
    assert draft_vocabulary(counts, 3).tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_vocabulary(counts, 6)


def test_teacher_forced_acceptance_counts_leading_correct_drafts():
    correct = torch.tensor([[True, True, False], [False, True, True], [True, True, True]])
    assert teacher_forced_acceptance(correct).tolist() == [3.0, 1.0, 4.0]


def test_schedule_aux_layers_threads_and_split():
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)
    assert default_aux_layers(30) == (1, 14, 26)  # vLLM's default: entering 2, 15, 27
    assert default_aux_layers(4) == (0, 2, 3)
    assert threads_to_use(0, 18.0, 2, 2) == 1 and threads_to_use(0, 0.5, 2, 2) == 2 and threads_to_use(3, 18, 2, 2) == 3
    train_set, val = split([[1]] * 40, 0.05)
    assert (len(train_set), len(val)) == (38, 2)
    with pytest.raises(ValueError, match="at least 2"):
        split([[1]], 0.05)


def test_humaneval_is_refused_as_training_data(tmp_path):
    with pytest.raises(ValueError, match="evaluation set"):
        check_not_evaluation_set(tmp_path / "HumanEval.jsonl")


# ------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("train") / "target", seed=3, num_hidden_layers=4)


def test_aux_layers_outside_the_target_are_refused_before_anything_is_written(target, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train-drafter", "--target", str(target), "--method", "eagle3", "--out", str(out),
                 "--aux-layers", "0,2,4"]) == 2
    err = capsys.readouterr().err
    assert "cannot attach" in err and "[4]" in err and "4 layers" in err and not out.exists()


def test_an_existing_output_directory_needs_overwrite(target, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert main(["train-drafter", "--target", str(target), "--method", "dflash", "--out", str(tmp_path / "out")]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_an_empty_dataset_is_refused(target, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert main(["train-drafter", "--target", str(target), "--method", "eagle3", "--out", str(tmp_path / "out"),
                 "--data", str(tmp_path / "empty.txt")]) == 2
    assert "nothing to train on" in capsys.readouterr().err


# ------------------------------------------------------------------ smoke runs


def smoke_config(target: Path, method: str, out: Path, steps: int) -> TrainConfig:
    # the target's own greedy continuations (self-distillation): text a drafter can learn
    return TrainConfig(target=str(target), method=method, out=str(out), seq_len=48, max_tokens=1200,
                       self_distill_tokens=24, steps=steps, eval_every=steps // 2, lr=3e-3, warmup_steps=5,
                       ttt_steps=3, draft_vocab_size=300, num_anchors=12, val_fraction=0.1, is_progress_shown=False)


def acceptance(target: Path, method: str, drafter: Path, prompts: list[list[int]]) -> tuple[float, bool]:
    """(pooled acceptance length, every output equal to plain) on the prompts, greedy, k = 3."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = EngineConfig(model=str(target), dtype="float32")
    with LLM(base) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(dataclasses.replace(base, spec=SpecConfig(method=method, draft_model=str(drafter),
                                                       num_draft_tokens=3))) as llm:
        outs = llm.generate(prompts, params)
    steps = sum(o.metrics["num_verify_steps"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    return (accepted + steps) / steps, [o.token_ids for o in outs] == plain


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_smoke_training_loss_falls_and_the_drafter_is_lossless_and_beats_a_random_one(target, tmp_path, method):
    cfg = smoke_config(target, method, tmp_path / method, steps=120)
    train(cfg)
    log = json.loads((tmp_path / method / LOG_FILE).read_text())["history"]
    assert log[-1]["train_loss"] < log[1]["train_loss"]
    assert (tmp_path / method / PLOT_FILE).stat().st_size > 0 and (tmp_path / method / STATE_FILE).is_file()
    from specray.training.loop import load_data

    train_set, _ = load_data(cfg, target, is_byte_level=True)  # the same text, seeded
    prompts = [chunk.tokens[:24] for chunk in train_set[:6]]
    trained, is_lossless = acceptance(target, method, tmp_path / method, prompts)
    random_dir = write_drafter_for(target, method, tmp_path / "random", seed=5)
    untrained, _ = acceptance(target, method, random_dir, prompts)
    assert is_lossless
    assert trained > untrained, (trained, untrained)


def test_resume_after_a_kill_at_a_checkpoint_ends_where_an_unbroken_run_ends(target, tmp_path, monkeypatch):
    from specray.training import loop

    whole = smoke_config(target, "eagle3", tmp_path / "whole", steps=12)
    train(whole)
    broken = dataclasses.replace(whole, out=str(tmp_path / "broken"))
    real_save = loop.save

    def save_then_die(*args):
        real_save(*args)
        raise KeyboardInterrupt  # killed right after the step-6 checkpoint

    monkeypatch.setattr(loop, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(broken)
    monkeypatch.setattr(loop, "save", real_save)
    assert torch.load(tmp_path / "broken" / STATE_FILE, weights_only=False)["step"] == 6
    # the resumed run reads the chunks it trained on, without generating the continuations again
    monkeypatch.setattr(loop, "load_data", lambda *args: pytest.fail("--resume made its data again"))
    train(broken, resume=True)
    a = torch.load(tmp_path / "whole" / STATE_FILE, weights_only=False)
    b = torch.load(tmp_path / "broken" / STATE_FILE, weights_only=False)
    assert b["step"] == 12 and [h["step"] for h in b["history"]] == [0, 6, 12]
    for name, tensor in a["trainee"].items():
        torch.testing.assert_close(b["trainee"][name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_written_drafter_loads_in_the_reference_implementation_with_equal_drafts(target, tmp_path, method):
    """Reference check: the references read what train-drafter wrote and draft what specray drafts."""
    import torch.nn.functional as F
    from checkpoints import load_reference
    from drafter_checkpoints import empty_pools, load, propose, target_features

    from specray.comm.context import DistContext
    from specray.workers.worker import load_model

    out = tmp_path / method
    train(dataclasses.replace(smoke_config(target, method, out, steps=4), self_distill_tokens=0))
    model, hf = load_model(target, DistContext.single(), "float32"), load_reference(target)
    drafter = load(method, out, model, k=3)
    tokens = [5, 17, 3, 99, 250, 7, 7, 42, 11, 300, 2, 64, 128, 33, 90, 1, 8, 77, 6, 45]
    features = target_features(model, hf, tokens, drafter.feature_layers)
    num_layers = 1 if method == "eagle3" else len(drafter.layers)
    drafts, _ = propose(drafter, tokens, features, 3, empty_pools(drafter, num_layers))
    if method == "eagle3":
        from test_drafter_formats import eagle3_reference

        ref_drafts, _ = eagle3_reference(out, hf, tokens, features, 3)
    else:
        from dflash.model import DFlashDraftModel

        ref = DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32, attn_implementation="sdpa").eval()
        n = ref.block_size
        with torch.no_grad():
            block = torch.tensor([[tokens[-1]] + [ref.mask_token_id] * (n - 1)])
            hidden = ref(target_hidden=features[None], noise_embedding=F.embedding(block, hf.model.embed_tokens.weight),
                         position_ids=torch.arange(0, len(tokens) - 1 + n)[None])[:, 1 - n:]
            ref_drafts = ref.compute_logits(hidden, hf.lm_head)[0].argmax(-1)[:3].tolist()
    assert drafts == ref_drafts


def test_chat_self_distillation_trains_on_prompts_and_the_targets_own_answers(target, tmp_path):
    from specray.training.data import function_stubs
    from specray.training.loop import load_data

    module = tmp_path / "mod.py"
    module.write_text('def area(r):\n    """Area of a circle."""\n    return 3.14 * r * r\n\n'
                      'def _hidden():\n    """Private."""\n\nclass A:\n    def size(self):\n'
                      '        """How big."""\n        return 1\n\ndef bare():\n    pass\n')
    assert function_stubs(module) == ['def area(r):\n    """Area of a circle."""\n',
                                      'def size(self):\n    """How big."""\n']
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(row) for row in (
        [{"prompt": f"def f{i}(x):"} for i in range(8)]
        + [{"messages": [{"role": "user", "content": "def g(y):"}, {"role": "assistant", "content": "dropped"}]}])))
    cfg = TrainConfig(target=str(target), method="eagle3", out=str(tmp_path / "out"), data=(str(prompts),),
                      seq_len=32, max_tokens=400, answer_tokens=20, is_prompt_masked=True, is_progress_shown=False)
    train_set, val_set = load_data(cfg, target, is_byte_level=True)
    stream = [t for chunk in train_set + val_set for t in chunk.tokens]
    assert all(len(chunk.tokens) == len(chunk.label_mask) == 32 for chunk in train_set + val_set)
    assert 32 * 2 <= len(stream) <= 400
    first = list(b"def f0(x):\n")  # no chat template: the prompt as text, then the target's greedy answer
    with LLM(EngineConfig(model=str(target), dtype="float32")) as llm:
        answer = llm.generate([first], SamplingParams(max_tokens=20, temperature=0.0))[0].token_ids
    assert stream[:len(first) + len(answer)] == first + answer
    # only the answer's labels count: position q's label predicts token q + 1
    mask = train_set[0].label_mask
    assert mask[:len(first) - 1] == [False] * (len(first) - 1)
    assert mask[len(first) - 1:len(first) + len(answer) - 1] == [True] * len(answer)
    with_prompts, _ = load_data(dataclasses.replace(cfg, is_prompt_masked=False), target, is_byte_level=True)
    assert with_prompts[0].tokens == train_set[0].tokens and with_prompts[0].label_mask is None
    assert b"dropped" not in bytes(t for t in stream if t < 256)
    with pytest.raises(ValueError, match="exclude each other"):
        dataclasses.replace(cfg, self_distill_tokens=8)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@torch.no_grad()
def test_labels_the_mask_leaves_out_change_neither_the_loss_nor_the_acceptance(target, tmp_path, method):
    from specray.training.data import Chunk
    from specray.training.loop import build_trainee, objective
    from specray.training.target import TargetFeatures

    cfg = TrainConfig(target=str(target), method=method, out=str(tmp_path), seq_len=32, ttt_steps=3, block_size=4,
                      num_anchors=6, is_progress_shown=False)
    features = TargetFeatures(target, default_aux_layers(4))
    chunk = Chunk(list(range(40, 72)), [q >= 12 for q in range(32)])  # the labels from position 12 on count
    hidden, labels = features.run(chunk.tokens)
    trainee = build_trainee(cfg, features, [chunk])
    loss, _, lengths = objective(cfg, trainee, features, hidden, chunk, labels, None)
    outside, inside = labels.clone(), labels.clone()
    outside[:12] = (outside[:12] + 1) % features.arch.vocab_size
    inside[20] = (inside[20] + 1) % features.arch.vocab_size
    loss_outside, _, lengths_outside = objective(cfg, trainee, features, hidden, chunk, outside, None)
    assert float(loss_outside) == float(loss) and torch.equal(lengths_outside, lengths)
    assert float(objective(cfg, trainee, features, hidden, chunk, inside, None)[0]) != float(loss)
