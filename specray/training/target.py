"""The target's side of training, computed by specray's own engine model: its sharded
``CausalLM`` (built with the rank's ``DistContext``, as serving builds it) runs a prefill of
each training sequence over a paged KV pool and returns the captured layer outputs (the
drafter's features) and its greedy next tokens (the labels). Features are cached per
sequence (bfloat16 to halve the memory) because every epoch reads them again.
"""

from __future__ import annotations

import torch

from specray.comm.context import DistContext
from specray.kv.geometry import POOL_KINDS
from specray.models.attention import build_metadata
from specray.models.decoder import CausalLM, side_by_side
from specray.models.loader import load_model

PAGE_SIZE = 64  # a page size the paged-attention kernel accepts


def check_feature_layers(layers: tuple[int, ...], num_target_layers: int, method: str) -> None:
    bad = [i for i in layers if not 0 <= i < num_target_layers]
    if not layers or bad:
        raise ValueError(f"{method} cannot attach to this target: aux layer ids {list(layers)} name layer outputs "
                         f"{bad or '(none)'} outside the target's {num_target_layers} layers (they must be in "
                         f"[0, {num_target_layers - 1}])")


class TargetFeatures:
    def __init__(self, model_path, feature_layers: tuple[int, ...], ctx: DistContext | None = None):
        self.ctx = ctx or DistContext.single()
        self.model: CausalLM = load_model(model_path, self.ctx, "float32", keep_blocks=False)  # its weights are read as tensors
        self.arch = self.model.arch
        self.feature_layers = tuple(feature_layers)
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def run(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [T, n * H] float32, greedy next token at each position [T])."""
        model, arch, dev = self.model, self.arch, self.ctx.device
        num_pages = -(-len(tokens) // PAGE_SIZE)
        layout = model.kv_layout  # K and V per kv head, or MLA's latent rows
        pools = [torch.zeros(num_pages, POOL_KINDS[layout.kind], layout.num_kv_heads, PAGE_SIZE, layout.head_dim,
                             device=dev) for _ in range(arch.num_layers)]
        positions, meta = build_metadata([list(range(num_pages))], PAGE_SIZE, [0], [len(tokens)], dev)
        ids = torch.tensor(tokens, device=dev)
        hidden, captured = model(ids, positions, pools, meta, capture_layers=self.feature_layers)
        return side_by_side(captured).float(), model.logits(hidden).argmax(-1)

    def cached(self, index: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self._cache:
            features, labels = self.run(tokens)
            self._cache[index] = (features.to(torch.bfloat16), labels)
        features, labels = self._cache[index]
        return features.float(), labels

    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight.detach()

    def head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight.detach()

    def norm_weight(self) -> torch.Tensor:
        return self.model.norm.weight.detach()
