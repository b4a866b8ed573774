"""The training loop of ``specray train-drafter``: data, the target's features from the
engine's model, the drafter's objective, evaluation on the validation split, checkpoints in
the published format (plus ``train_state.pt`` to resume) and the plot, every ``eval_every``
steps and at the end."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from specray.models.loader import read_model_arch
from specray.models.presets import resolve_model
from specray.models.tokenizer import load_tokenizer
from specray.training.data import Chunk, file_chats, split, stdlib_chats, token_chunks
from specray.training.distill import answer_chats, continue_chunks
from specray.training.recipe import TrainConfig, default_aux_layers, lr_at, threads_to_use
from specray.training.target import TargetFeatures, check_feature_layers

STATE_FILE = "train_state.pt"
DATA_FILE = "train_data.json"  # the token chunks: --resume reads them instead of generating answers again
LOG_FILE = "train_log.json"
PLOT_FILE = "training.png"
OUTPUT_FILES = ("config.json", "model.safetensors", STATE_FILE, DATA_FILE, LOG_FILE, PLOT_FILE)
# the settings that decide the chunks: a resumed run with the same ones reads DATA_FILE
DATA_KEYS = ("target", "data", "seq_len", "max_tokens", "val_fraction", "self_distill_tokens", "answer_tokens",
             "is_prompt_masked", "seed")


def prepare_out(out: Path, overwrite: bool, resume: bool) -> None:
    """The output directory: new, or --overwrite (our files removed), or --resume (its state read)."""
    if resume:
        if not (out / STATE_FILE).is_file():
            raise ValueError(f"--resume: {str(out)!r} has no {STATE_FILE} to resume from")
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise ValueError(f"output directory {str(out)!r} exists and is not empty: pass --overwrite to replace "
                             f"its drafter, --resume to continue its training, or another --out")
        if not out.is_dir():
            raise ValueError(f"output {str(out)!r} is a file, not a directory")
        for name in OUTPUT_FILES:
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def build_trainee(cfg: TrainConfig, target: TargetFeatures, train_set, kept_ids=None):
    from specray.training.dflash_trainee import DFlashTrainee
    from specray.training.eagle3_trainee import Eagle3Trainee, draft_vocabulary

    torch.manual_seed(cfg.seed)
    arch = target.arch
    if cfg.method == "dflash":
        mask = arch.vocab_size - 1 if cfg.mask_token_id is None else cfg.mask_token_id
        return DFlashTrainee(arch, target.feature_layers, cfg.num_layers, cfg.block_size, mask, cfg.gamma)
    if kept_ids is None:  # the draft vocabulary: the target's most frequent greedy tokens on the data
        counts = torch.zeros(arch.vocab_size, dtype=torch.int64)
        for i, chunk in enumerate(train_set):
            labels = target.cached(i, chunk.tokens)[1]
            if chunk.label_mask is not None:
                labels = labels[torch.tensor(chunk.label_mask)]
            counts += torch.bincount(labels, minlength=arch.vocab_size)
        kept_ids = draft_vocabulary(counts, min(cfg.draft_vocab_size, arch.vocab_size))
    return Eagle3Trainee(arch, target.feature_layers, kept_ids, target.head_weight(), target.norm_weight())


def objective(cfg: TrainConfig, trainee, target: TargetFeatures, features, chunk: Chunk, labels, generator):
    """(loss, per-position accuracy, teacher-forced acceptance per chain) of one sequence."""
    tokens = torch.tensor(chunk.tokens)
    mask = None if chunk.label_mask is None else torch.tensor(chunk.label_mask)
    if cfg.method == "eagle3":
        return trainee.unroll(features, tokens, labels, target.embed_weight(), cfg.ttt_steps, mask)
    anchors = trainee.anchors(tokens.numel(), cfg.num_anchors, generator, mask)
    return trainee.block_loss(features, tokens, labels, target.embed_weight(), target.head_weight(), anchors,
                              min(cfg.block_size - 1, 7), mask)


@torch.no_grad()
def evaluate(cfg: TrainConfig, trainee, target: TargetFeatures, val_set, offset: int) -> dict:
    losses, accs, lengths = [], [], []
    for i, chunk in enumerate(val_set):
        features, labels = target.cached(offset + i, chunk.tokens)
        loss, acc, al = objective(cfg, trainee, target, features, chunk, labels, None)
        losses.append(float(loss)), accs.append(acc), lengths.append(al)
    # nanmean: a validation chunk whose label mask starts no whole chain has no accuracy to give
    return dict(val_loss=sum(losses) / len(losses), val_accuracy_per_position=torch.stack(accs).nanmean(0).tolist(),
                val_acceptance_length=float(torch.cat(lengths).mean()))


def save(out: Path, cfg: TrainConfig, trainee, optimizer, step: int, history: list[dict]) -> None:
    from specray.models.checkpoint_writer import write_checkpoint
    from specray.training.plot import plot_history

    write_checkpoint(out, trainee.config(), trainee.weights())
    state = dict(config=cfg.as_dict(), step=step, history=history, trainee=trainee.state_dict(),
                 optimizer=optimizer.state_dict(), rng=torch.get_rng_state())
    torch.save(state, out / (STATE_FILE + ".tmp"))
    (out / (STATE_FILE + ".tmp")).replace(out / STATE_FILE)  # a crash mid-save keeps the previous state
    (out / LOG_FILE).write_text(json.dumps(dict(config=cfg.as_dict(), history=history), indent=2))
    plot_history(history, out / PLOT_FILE, f"{cfg.method} drafter for {cfg.target}")


def _resumed_state(out: Path, cfg: TrainConfig) -> dict:
    state = torch.load(out / STATE_FILE, weights_only=False)
    saved = state["config"]
    for key in ("target", "method", "aux_layers", "seq_len", "num_layers", "block_size", "draft_vocab_size"):
        if key in saved and saved[key] != getattr(cfg, key) and not (key == "aux_layers" and cfg.aux_layers is None):
            raise ValueError(f"--resume: {str(out)!r} was trained with {key}={saved[key]!r}, not {getattr(cfg, key)!r}")
    return state


def load_data(cfg: TrainConfig, model_path: Path, is_byte_level: bool) -> tuple[list[Chunk], list[Chunk]]:
    tokenizer = load_tokenizer(model_path, is_byte_level=is_byte_level)
    paths = [Path(p) for p in cfg.data]
    if cfg.answer_tokens:
        chats = [chat for path in paths for chat in file_chats(path)] if paths else stdlib_chats(cfg.seed)
        chunks = answer_chats(chats, tokenizer, cfg)
        if not chunks:
            raise ValueError(f"the answered prompts ({len(chats)}) hold fewer tokens than one sequence of seq_len "
                             f"{cfg.seq_len}: nothing to train on")
        return split(chunks, cfg.val_fraction)
    chunks = token_chunks(paths, tokenizer, cfg.seq_len, cfg.max_tokens, cfg.seed)
    if cfg.self_distill_tokens:
        chunks = continue_chunks(chunks, cfg)
    return split([Chunk(c) for c in chunks], cfg.val_fraction)


def data_for(cfg: TrainConfig, out: Path, model_path: Path, is_byte_level: bool, resume: bool):
    """The (train, validation) chunks: from ``out``'s DATA_FILE when resuming a run with the same
    data settings, else made (generating answers can take minutes) and written there."""
    key = json.loads(json.dumps({name: getattr(cfg, name) for name in DATA_KEYS}))
    if resume and (out / DATA_FILE).is_file():
        saved = json.loads((out / DATA_FILE).read_text())
        if saved["key"] == key:
            return [Chunk(*c) for c in saved["train"]], [Chunk(*c) for c in saved["val"]]
    train_set, val_set = load_data(cfg, model_path, is_byte_level)
    (out / (DATA_FILE + ".tmp")).write_text(json.dumps(dict(key=key, train=train_set, val=val_set)))
    (out / (DATA_FILE + ".tmp")).replace(out / DATA_FILE)
    return train_set, val_set


def train(cfg: TrainConfig, *, overwrite: bool = False, resume: bool = False) -> dict:
    """Train (or resume) the drafter ``cfg`` describes; returns the last evaluation."""
    from specray.models.presets import is_preset

    out = Path(cfg.out)
    torch.set_num_threads(threads_to_use(cfg.num_threads, os.getloadavg()[0], os.cpu_count() or 1,
                                         torch.get_num_threads()))
    model_path = resolve_model(cfg.target)
    arch = read_model_arch(model_path)
    layers = cfg.aux_layers if cfg.aux_layers is not None else default_aux_layers(arch.num_layers)
    check_feature_layers(tuple(layers), arch.num_layers, cfg.method)  # before any output is touched
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("train-drafter plots its loss and acceptance with matplotlib, which is not installed: "
                         "pip install 'specray[bench]'")
    prepare_out(out, overwrite, resume)
    state = _resumed_state(out, cfg) if resume else None
    train_set, val_set = data_for(cfg, out, model_path, is_preset(cfg.target) or Path(model_path).is_dir(), resume)
    target = TargetFeatures(model_path, tuple(layers))
    kept = None
    if state is not None and cfg.method == "eagle3":
        d2t = state["trainee"]["d2t"]
        kept = d2t + torch.arange(d2t.numel())
    trainee = build_trainee(cfg, target, train_set, kept)
    optimizer = torch.optim.AdamW(trainee.parameters(), lr=cfg.lr, weight_decay=0.0)
    step, history = 0, []
    if state is not None:
        trainee.load_state_dict(state["trainee"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        torch.set_rng_state(state["rng"])
    if not history:
        history.append(dict(step=0, train_loss=None, elapsed_s=0.0,
                            **evaluate(cfg, trainee, target, val_set, len(train_set))))
    return _steps(cfg, out, trainee, optimizer, target, train_set, val_set, step, history)


def _steps(cfg, out, trainee, optimizer, target, train_set, val_set, step, history) -> dict:
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    num, epoch, order = len(train_set), -1, []
    started, elapsed0, window = time.perf_counter(), history[-1]["elapsed_s"], []
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {cfg.method}", disable=not cfg.is_progress_shown,
               unit="step")
    while step < cfg.steps:
        if step // num != epoch:  # a seeded order per epoch, so a resumed run sees what it would have
            epoch, order = step // num, list(range(num))
            random.Random(cfg.seed + epoch).shuffle(order)
        i = order[step % num]
        features, labels = target.cached(i, train_set[i].tokens)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.warmup_steps)
        loss, _, _ = objective(cfg, trainee, target, features, train_set[i], labels, generator)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainee.parameters(), 1.0)
        optimizer.step()
        step += 1
        window.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{window[-1]:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            history.append(dict(step=step, train_loss=sum(window) / len(window),
                                elapsed_s=elapsed0 + time.perf_counter() - started,
                                **evaluate(cfg, trainee, target, val_set, len(train_set))))
            window = []
            tqdm.write(f"step {step}: train loss {history[-1]['train_loss']:.3f}, val loss "
                      f"{history[-1]['val_loss']:.3f}, val acceptance length (teacher-forced) "
                      f"{history[-1]['val_acceptance_length']:.3f}", file=sys.stdout)
            sys.stdout.flush()  # visible at once when stdout is a file (a log of a long run)
            save(out, cfg, trainee, optimizer, step, history)
    bar.close()
    if history[-1]["step"] == 0:  # nothing trained (steps already reached): still write the drafter
        save(out, cfg, trainee, optimizer, step, history)
    return history[-1]
