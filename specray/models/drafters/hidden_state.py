"""``mtp``: a one-model drafter conditioned on the target's final hidden state (DeepSeek-V3
style multi-token prediction), in specray's own ``SpecrayMTPDrafter`` format until the MTP
layouts of the target checkpoints themselves are read (issue 13, item 4). ``eagle3`` now
lives in eagle3.py and reads EAGLE-3's published formats.

One Llama-style decoder layer whose KV lives in the target's pool (the last layer of it);
the target's block tables, embedding and LM head. Position p of the draft layer combines
the feature for position p with the embedding of token p + 1 and predicts token p + 2:

    x_p = eh_proj([enorm(embed(t_{p+1})); hnorm(f_p)]),  g_p = layer(x_p),  logits = lm_head(norm(g_p))

with f_p = the target's final hidden state at p (one MTP module, reused for every draft as
vLLM does when k exceeds the module count).

Each step catches up on the positions verified since the last step (target features),
then drafts autoregressively with f = the layer's own output g (the features of a
speculative position are the drafter's, so those positions are recomputed next step).

Checkpoint (a directory): ``config.json`` with ``architectures`` = ["SpecrayMTPDrafter"], the
Llama-style layer sizes (hidden_size, intermediate_size, num_attention_heads,
num_key_value_heads, head_dim, rms_norm_eps, rope_theta) and ``vocab_size`` (the target's);
safetensors with ``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight`` [H, 2H],
``norm.weight`` and the layer under ``layers.0.`` in Hugging Face Llama names. Sharding:
eh_proj replicated, the layer as in decoder.py.
"""

from __future__ import annotations

import torch
from torch import nn

from specray.comm.context import DistContext
from specray.kv.geometry import KVLayout
from specray.models.arch import ModelArch
from specray.models.decoder import CausalLM, DecoderLayer
from specray.models.attention import build_metadata
from specray.models.drafters.common import FINAL_HIDDEN, Choose, DraftBatch, ReplicatedLinear, last_rows
from specray.models.layers import RMSNorm, RotaryEmbedding


class HiddenStateDrafter(nn.Module):
    is_standalone = False
    reuses_draft_kv = False

    def __init__(self, arch: ModelArch, target: CausalLM, ctx: DistContext, dtype: torch.dtype,
                 feature_layers: tuple[int, ...]):
        super().__init__()
        h, dev, eps = arch.hidden_size, ctx.device, arch.rms_norm_eps
        self.arch = arch
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, dev)
        self.feature_layers = feature_layers
        self.target = [target]  # a list so the target's modules are not registered twice
        self.fc = ReplicatedLinear(len(feature_layers) * h, h, dtype, dev) if feature_layers != (FINAL_HIDDEN,) else None
        self.enorm = RMSNorm(h, eps, dtype, dev)
        self.hnorm = RMSNorm(h, eps, dtype, dev)
        self.eh_proj = ReplicatedLinear(2 * h, h, dtype, dev)
        self.layer = DecoderLayer(arch, 0, ctx, dtype)
        self.norm = RMSNorm(h, eps, dtype, dev)
        self.kv_layout = KVLayout(1, self.layer.self_attn.num_local_kv_heads, arch.head_dim)

    @torch.no_grad()
    def load(self, reader) -> None:
        if self.fc is not None:
            self.fc.load(reader, "fc.weight")
        self.enorm.load(reader, "enorm.weight")
        self.hnorm.load(reader, "hnorm.weight")
        self.eh_proj.load(reader, "eh_proj.weight")
        self.layer.load(reader, "layers.0")
        self.norm.load(reader, "norm.weight")

    def _step(self, batch: DraftBatch, ids: torch.Tensor, features: torch.Tensor, starts: list[int],
              lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, g) at each sequence's last row, for draft positions ``starts[i] + [0, lens[i])``."""
        target = self.target[0]
        positions, meta = build_metadata([s.block_table for s in batch.seqs], batch.block_size, starts, lens,
                                         batch.device)
        cos, sin = self.rotary(positions, max(meta.context_lens_list))
        x = self.eh_proj(torch.cat([self.enorm(target.embed_tokens(ids)), self.hnorm(features)], dim=-1))
        g = self.layer(x, cos, sin, batch.pools[0], meta)[last_rows(lens, batch.device)]
        return target.logits(self.norm(g)), g

    def propose(self, batch: DraftBatch, choose: Choose) -> torch.Tensor:
        seqs = batch.seqs
        # catch-up: positions [consumed, L - 1) pair the target's features with tokens consumed+1 .. L-1
        starts = [s.num_consumed for s in seqs]
        lens = [len(s.tokens) - 1 - s.num_consumed for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.tokens[s.num_consumed + 1:]], device=batch.device)
        features = torch.cat([s.features for s in seqs])
        if self.fc is not None:
            features = self.fc(features)
        logits, g = self._step(batch, ids, features, starts, lens)
        drafts = [choose(logits, 0)]
        for j in range(1, batch.k):
            starts = [len(s.tokens) - 2 + j for s in seqs]
            logits, g = self._step(batch, drafts[-1], g, starts, [1] * len(seqs))
            drafts.append(choose(logits, j))
        return torch.stack(drafts, dim=1)
