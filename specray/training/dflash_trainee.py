"""DFlash in training: z-lab's published drafter (dflash.py has the equations) with its
block objective.

An *anchor* a is a position whose token is known: its block is [t_a, mask x (B - 1)] at
positions a .. a + B - 1, attending without a causal mask to the context (the target's
features at positions < a, through ``fc``, ``hidden_norm`` and each layer's own k/v
projection) and to its own block, as the drafter does when the sequence has a + 1 tokens.
Row i >= 1 of the block is trained to the target's greedy token at position a + i (the
target's argmax after position a + i - 1), weighted exp(-(i - 1) / gamma) as the DFlash
paper weights block positions (nearer drafts matter more: a later one counts only if every
earlier one was accepted). Many anchors of one sequence train together, each block seeing
only its own context prefix. With a label mask, anchors are drawn where the first label
counts and a row's loss counts where its own label does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.arch import ModelArch
from specray.models.drafter_presets import dflash_config
from specray.models.layers import RotaryEmbedding
from specray.training.eagle3_trainee import teacher_forced_acceptance
from specray.training.layers import Layer, RMSNorm, linear


class DFlashTrainee(nn.Module):
    def __init__(self, target: ModelArch, feature_layers: tuple[int, ...], num_layers: int, block_size: int,
                 mask_token_id: int, gamma: float):
        super().__init__()
        if block_size < 2:
            raise ValueError(f"block_size ({block_size}) must be >= 2 (one known token and a mask)")
        if not 0 <= mask_token_id < target.vocab_size:
            raise ValueError(f"mask_token_id ({mask_token_id}) must be a token of the target's vocabulary "
                             f"[0, {target.vocab_size})")
        h = target.hidden_size
        self.arch, self.feature_layers = target, tuple(feature_layers)
        self.block_size, self.mask_token_id, self.gamma = block_size, mask_token_id, gamma
        self.fc = linear(len(feature_layers) * h, h)
        self.hidden_norm = RMSNorm(h, target.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(target, h, has_qk_norm=True) for _ in range(num_layers))
        self.norm = RMSNorm(h, target.rms_norm_eps)
        self.rotary = RotaryEmbedding(target.head_dim, target.rope_theta, torch.device("cpu"))

    def config(self) -> dict:
        """config.json as z-lab writes it (Qwen3 layer sizes, dflash_config)."""
        cfg = dflash_config(self.arch, self.block_size)
        cfg.update(num_hidden_layers=len(self.layers), model_type="qwen3")
        cfg["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.feature_layers)}
        return cfg

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.state_dict().items()}

    def anchors(self, num_tokens: int, num: int, generator: torch.Generator | None, label_mask=None) -> torch.Tensor:
        """Anchor positions in [1, num_tokens - block_size + 1] (where the label mask, if any, counts
        the anchor's label; all of them when it counts none there): random (training) or evenly spread."""
        last = num_tokens - self.block_size + 1
        if last < 1:
            raise ValueError(f"sequences of {num_tokens} tokens are too short for blocks of {self.block_size}")
        allowed = torch.arange(1, last + 1)
        if label_mask is not None and label_mask[allowed].any():
            allowed = allowed[label_mask[allowed]]
        if generator is None:
            return allowed[torch.linspace(0, allowed.numel() - 1, min(num, allowed.numel())).round().long().unique()]
        return allowed[torch.randperm(allowed.numel(), generator=generator)[:num]].sort().values

    def block_loss(self, features, tokens, labels, embed_weight, head_weight, anchors: torch.Tensor, k: int,
                   label_mask=None):
        """(loss, per-row accuracy [B - 1], teacher-forced acceptance per block at k drafts);
        ``label_mask`` [T] bool: the labels that count (None: all)."""
        n, num_ctx = self.block_size, tokens.numel()
        offsets = torch.arange(n)
        positions = (anchors[:, None] + offsets[None]).reshape(-1)
        ids = torch.full((anchors.numel(), n), self.mask_token_id)
        ids[:, 0] = tokens[anchors]
        x = F.embedding(ids.reshape(-1), embed_weight)
        block_of = torch.arange(anchors.numel()).repeat_interleave(n)
        ctx_visible = torch.arange(num_ctx)[None, :] < anchors.repeat_interleave(n)[:, None]
        visible = torch.cat([ctx_visible, block_of[:, None] == block_of[None, :]], dim=1)
        context = self.hidden_norm(self.fc(features))
        ctx_cos, ctx_sin = self.rotary(torch.arange(num_ctx), num_ctx)
        cos, sin = self.rotary(positions, int(positions.max()) + 1)
        for layer in self.layers:
            attn = layer.self_attn
            kc, vc = attn.keys_values(context, ctx_cos, ctx_sin)
            hx = layer.input_layernorm(x)
            kb, vb = attn.keys_values(hx, cos, sin)
            x = x + attn.attend(attn.queries(hx, cos, sin), torch.cat([kc, kb]), torch.cat([vc, vb]), visible)
            x = layer.feed_forward(x)
        rows = self.norm(x).view(anchors.numel(), n, -1)[:, 1:]
        logits = F.linear(rows, head_weight)
        at = anchors[:, None] + offsets[None, :-1]
        target = labels[at]
        counts = torch.ones_like(target, dtype=torch.bool) if label_mask is None else label_mask[at]
        weights = torch.tensor([math.exp(-i / self.gamma) for i in range(n - 1)]) * counts
        per_row = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        loss = (per_row.view(-1, n - 1) * weights).sum() / weights.sum().clamp(min=1e-6)
        correct = (logits.argmax(-1) == target) & counts
        return loss, correct.float().mean(0), teacher_forced_acceptance(correct[:, :k])
