"""EAGLE-3 in training: the published layer (eagle3.py has the equations) with its
training-time test unroll, and its draft vocabulary.

The unroll (EAGLE-3's "training-time test", as SpecForge and ``speculators`` train it)
makes training see what drafting sees. Row p of unroll step 0 is the drafter's catch-up
position p: the target's features at p and token p + 1, predicting the target's next token
after p + 1. Unroll step j continues the chain that row p starts, as draft step j at position
p + j: its hidden input is step j - 1's output ``g`` at row p (the drafter's own, not the
target's), its token the text's token p + j + 1, and it attends to step 0's keys at rows
<= p (the verified context) plus the keys of steps 1 .. j at row p (the chain's own drafts),
exactly the keys specray's drafter has cached when it drafts there. RoPE positions are
p + j, as in specray's drafter. Step j's loss is weighted 0.8^j (SpecForge's decay).

Labels are the target's greedy tokens (cross-entropy to the target's argmax), kept when that
token is in the draft vocabulary and the chunk's label mask (if any) counts it; the acceptance
is measured over the chains whose first label counts. The draft vocabulary is the
``draft_vocab_size`` most frequent target tokens of the training data; draft id i is target id
i + d2t[i].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.arch import ModelArch
from specray.models.drafter_presets import eagle3_config
from specray.models.layers import RotaryEmbedding
from specray.training.layers import Layer, RMSNorm, linear

STEP_DECAY = 0.8


def draft_vocabulary(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Sorted target ids of the ``draft_vocab_size`` most frequent tokens (ties: lower id first)."""
    if not 0 < draft_vocab_size <= counts.numel():
        raise ValueError(f"draft_vocab_size ({draft_vocab_size}) must be in [1, {counts.numel()}] (the vocabulary)")
    values = counts.tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    return torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.int64)


def teacher_forced_acceptance(correct: torch.Tensor) -> torch.Tensor:
    """Per chain (rows), 1 + the number of leading correct drafts: correct is [rows, k] bool."""
    return 1.0 + correct.long().cumprod(dim=1).sum(dim=1).float()


class Eagle3Trainee(nn.Module):
    def __init__(self, target: ModelArch, feature_layers: tuple[int, ...], kept_ids: torch.Tensor,
                 lm_head_init: torch.Tensor, norm_init: torch.Tensor):
        super().__init__()
        h = target.hidden_size
        self.arch, self.feature_layers = target, tuple(feature_layers)
        self.fc = linear(len(feature_layers) * h, h)
        self.midlayer = Layer(target, 2 * h, has_qk_norm=False)
        self.midlayer.hidden_norm = RMSNorm(h, target.rms_norm_eps)
        self.norm = RMSNorm(h, target.rms_norm_eps)
        self.lm_head = nn.Linear(h, kept_ids.numel(), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_init[kept_ids])
            self.norm.weight.copy_(norm_init)
        self.register_buffer("d2t", kept_ids - torch.arange(kept_ids.numel()))
        t2d = torch.full((target.vocab_size,), -1, dtype=torch.int64)
        t2d[kept_ids] = torch.arange(kept_ids.numel())
        self.t2d = t2d  # not saved: derived from d2t
        self.rotary = RotaryEmbedding(target.head_dim, target.rope_theta, torch.device("cpu"))

    def config(self) -> dict:
        """config.json in SpecForge's layout (aux ids nested: the outputs of those layers)."""
        cfg = eagle3_config(self.arch, "specforge", self.lm_head.weight.shape[0])
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(self.feature_layers)
        return cfg

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.state_dict().items()}

    def unroll(self, features, tokens, labels, embed_weight, num_steps: int, label_mask=None):
        """(loss, per-step accuracy [num_steps], teacher-forced acceptance per chain) of one sequence;
        ``label_mask`` [T] bool: the labels that count (None: all)."""
        num_rows = tokens.numel()
        rows = torch.arange(num_rows)
        causal = rows[None, :] <= rows[:, None]
        h, attn = self.fc(features), self.midlayer.self_attn
        k0 = v0 = None
        extra, losses, correct = [], [], []
        chains = num_rows - num_steps  # rows whose every step has a label
        for j in range(num_steps):
            src = (rows + j + 1).clamp(max=num_rows - 1)
            valid = (rows + j + 1 < num_rows) & (self.t2d[labels[src]] >= 0)
            if label_mask is not None:
                valid &= label_mask[src]
            cos, sin = self.rotary(rows + j, num_rows + j)
            hidden = self.midlayer.hidden_norm(h)
            x = torch.cat([self.midlayer.input_layernorm(F.embedding(tokens[src], embed_weight)), hidden], dim=-1)
            q = attn.queries(x, cos, sin)
            k, v = attn.keys_values(x, cos, sin)
            if j == 0:
                k0, v0 = k, v
            else:
                extra.append((k, v))
            g = self.midlayer.feed_forward(h + attn.attend(q, k0, v0, causal, extra))
            logits = self.lm_head(self.norm(g))
            target = self.t2d[labels[src]].clamp(min=0)
            step_loss = F.cross_entropy(logits[valid], target[valid]) if valid.any() else logits.sum() * 0
            losses.append(STEP_DECAY ** j * step_loss)
            correct.append((logits.argmax(-1) == target) & valid)
            h = g
        hits = torch.stack(correct, dim=1)[:max(chains, 0)]
        if label_mask is not None:  # the chains a drafter runs: those that start on a counted label
            hits = hits[label_mask[1:1 + hits.shape[0]]]
        weight = sum(STEP_DECAY ** j for j in range(num_steps))
        return sum(losses) / weight, hits.float().mean(0), teacher_forced_acceptance(hits)
