"""What one training run is: the frozen, validated configuration of ``specray train-drafter``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

METHODS = ("eagle3", "dflash")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    target: str  # a built-in model, preset, checkpoint directory or .gguf file
    method: str
    out: str
    data: tuple[str, ...] = ()  # text/JSONL files; () = the standard library's sources
    aux_layers: tuple[int, ...] | None = None  # target layer outputs the drafter reads; None: the method's default
    seq_len: int = 256
    max_tokens: int = 60_000  # tokens of text read (before the validation split)
    val_fraction: float = 0.05
    self_distill_tokens: int = 0  # >0: append the target's greedy continuation of this many tokens to each prefix
    answer_tokens: int = 0  # >0: train on the target's greedy chat answers (at most this long) to prompts
    is_prompt_masked: bool = False  # answer_tokens: only the answers' labels count (default: every label)
    steps: int = 600
    lr: float = 1e-3
    warmup_steps: int = 20
    eval_every: int = 50
    ttt_steps: int = 7  # eagle3: unroll length
    draft_vocab_size: int = 8192  # eagle3
    num_layers: int = 1  # dflash
    block_size: int = 8  # dflash: up to 7 drafts per forward
    mask_token_id: int | None = None  # dflash; None: the last token of the vocabulary
    num_anchors: int = 24  # dflash: blocks per sequence per step
    gamma: float = 4.0  # dflash: position decay of the block loss
    seed: int = 0
    num_threads: int = 0  # torch threads; 0: 1 when the machine is busier than its cores, else torch's default
    is_progress_shown: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} must be one of {list(METHODS)}")
        for name in ("seq_len", "max_tokens", "steps", "eval_every", "ttt_steps", "draft_vocab_size", "num_layers",
                     "block_size", "num_anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction ({self.val_fraction}) must be in (0, 1)")
        if self.lr <= 0 or self.gamma <= 0:
            raise ValueError(f"lr ({self.lr}) and gamma ({self.gamma}) must be > 0")
        if self.num_threads < 0:
            raise ValueError(f"num_threads ({self.num_threads}) must be >= 0 (0: automatic)")
        if min(self.self_distill_tokens, self.answer_tokens, self.warmup_steps) < 0:
            raise ValueError(f"self_distill_tokens ({self.self_distill_tokens}), answer_tokens ({self.answer_tokens}) "
                             f"and warmup_steps ({self.warmup_steps}) must be >= 0")
        if self.self_distill_tokens and self.answer_tokens:
            raise ValueError(f"self_distill_tokens ({self.self_distill_tokens}) and answer_tokens "
                             f"({self.answer_tokens}) exclude each other: answers are already the target's own text")

    def as_dict(self) -> dict:
        return asdict(self)


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """Low, middle and high layer outputs: vLLM's EAGLE-3 default (entering 2, L // 2, L - 3,
    i.e. outputs 1, L // 2 - 1, L - 4) where the target is deep enough, else first/middle/last."""
    if num_target_layers >= 8:
        return (1, num_target_layers // 2 - 1, num_target_layers - 4)
    return tuple(sorted({0, num_target_layers // 2, num_target_layers - 1}))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it at ``total``."""
    import math

    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def threads_to_use(requested: int, load_average: float, num_cores: int, default: int) -> int:
    """``requested``, or when 0: one thread on a machine busier than its cores (measured here:
    a small matmul ran 17x slower on 2 threads than on 1 at load 18 on 2 cores, the threads
    waiting for each other), else torch's default."""
    if requested:
        return requested
    return 1 if load_average > num_cores else default
