"""`specray train-drafter`: flags -> TrainConfig -> loop.train."""

from __future__ import annotations

import argparse

from specray.training.recipe import METHODS, TrainConfig


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_train_drafter_parser(commands) -> None:
    d = TrainConfig(target="-", method="eagle3", out="-")
    p = commands.add_parser("train-drafter", help="distil an EAGLE-3 or DFlash drafter from a target (CPU)",
                            description="Distil a drafter from the target on text the machine has (by default the "
                                        "Python standard library's sources); written in the published format. "
                                        "See docs/training.md.")
    p.add_argument("--target", required=True, help="built-in model (smollm2-135m), preset, checkpoint dir or .gguf")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--out", required=True, help="output directory (the drafter, train_state.pt, training.png)")
    p.add_argument("--overwrite", action="store_true", help="replace the drafter in an existing --out")
    p.add_argument("--resume", action="store_true", help="continue from --out's last checkpoint")
    p.add_argument("--data", action="append", default=[], metavar="FILE",
                   help="text or JSONL file (repeatable); default: the standard library's sources")
    p.add_argument("--aux-layers", type=_ints, default=None,
                   help="target layer outputs the drafter reads, e.g. 1,14,26 (default: low, middle, high)")
    p.add_argument("--self-distill-tokens", type=int, default=d.self_distill_tokens,
                   help="replace each sequence's tail by the target's greedy continuation of this many tokens")
    p.add_argument("--answer-tokens", type=int, default=d.answer_tokens,
                   help="train on the target's own greedy chat answers (at most this many tokens each) to prompts: "
                        "the standard library's documented functions, or the prompt/messages rows of --data JSONL")
    p.add_argument("--mask-prompts", action="store_true",
                   help="with --answer-tokens: count only the answers' labels (SpecForge's loss mask over assistant "
                        "turns); measured worse on HumanEval here, see docs/training.md")
    for name in ("seq_len", "max_tokens", "steps", "warmup_steps", "eval_every", "ttt_steps", "draft_vocab_size",
                 "num_layers", "block_size", "num_anchors", "seed", "num_threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("lr", "val_fraction", "gamma"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--mask-token-id", type=int, default=None, help="dflash: the mask token (default: the last id)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_train_drafter)


def run_train_drafter(args: argparse.Namespace) -> int:
    from specray.training.loop import train

    cfg = TrainConfig(target=args.target, method=args.method, out=args.out, data=tuple(args.data),
                      aux_layers=args.aux_layers, seq_len=args.seq_len, max_tokens=args.max_tokens,
                      val_fraction=args.val_fraction, self_distill_tokens=args.self_distill_tokens,
                      answer_tokens=args.answer_tokens, is_prompt_masked=args.mask_prompts, steps=args.steps,
                      lr=args.lr, warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                      ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size, num_layers=args.num_layers,
                      block_size=args.block_size, mask_token_id=args.mask_token_id, num_anchors=args.num_anchors,
                      gamma=args.gamma, seed=args.seed, num_threads=args.num_threads, is_progress_shown=not args.no_progress)
    last = train(cfg, overwrite=args.overwrite, resume=args.resume)
    print(f"wrote {args.method} drafter to {args.out} (step {last['step']}: validation loss {last['val_loss']:.3f}, "
          f"teacher-forced acceptance length {last['val_acceptance_length']:.3f}); "
          f"use it with --spec {args.method} --draft-model {args.out}")
    return 0
