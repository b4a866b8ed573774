"""Hybrid linear-attention targets (Qwen3-Next's shape, random weights): plain decode against
transformers on the same checkpoint, and what a speculative verify with its state commit costs.

    python -m benchmarks.bench_hybrid                 # --size mid, batch 1 and 8, k 1 3 7
    python -m benchmarks.bench_hybrid --size tiny --json bench-results/hybrid.json

Three tables, one process, the same threads for everything:

1. **decode**: median TPOT of specray (local launcher, greedy, ``--output-len`` tokens after a
   prompt of ``--input-len``) and of transformers' ``generate`` (its torch fallbacks for the
   linear layers: chunked rule for the prompt, recurrent rule per token), batch 1 and 8, equal-
   length prompts so neither pads. transformers' TPOT is (t(N tokens) - t(1 token)) / (N - 1).
2. **verify**: one model forward (and LM head) of B sequences at context ``--context``: a plain
   step of 1 row each against a verify step of 1 + k rows each, the linear layers keeping the
   state after every position, plus the commit (``linear_state.commit_accepted``, a random
   accepted count per row). ``verify / plain`` is the step's cost ratio; a verify pays off when
   the acceptance length exceeds it.
3. **snapshot vs replay**, per step over all linear layers: the snapshot scheme's extra work (the
   recurrent rule keeping every position's state and writing it to the scratch rows, against
   keeping only the last, plus the commit copy) against a replay scheme's (re-running the
   recurrent rule and the conv from the step's checkpoint over the n + 1 accepted tokens, n
   uniform in 0..k: the rule's own cost on the layer's shapes, with the inputs kept).

The machine may be shared: each number is the fastest of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specray import LLM, EngineConfig, KVConfig, SamplingParams
from specray.bench import format_table
from specray.comm.context import DistContext
from specray.kv.state import StateGeometry, allocate_state_pool
from specray.models.attention import build_metadata
from specray.models.checkpoint_writer import random_weights, write_checkpoint
from specray.models.gated_delta import recurrent_gated_delta_rule
from specray.models.linear_state import commit_accepted
from specray.models.loader import load_model
from specray.models.presets import PRESETS

BLOCK = 16
# Qwen3-Next's proportions at ~1/4 width: three Gated DeltaNet layers to one gated attention layer,
# 16 value heads of 64 over 8 key heads (80B: 32 of 128 over 16), 32 experts with a shared one
MID = dict(PRESETS["tiny-qwen3-next"], vocab_size=32000, hidden_size=1024, num_hidden_layers=8,
           layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, num_attention_heads=8,
           num_key_value_heads=2, head_dim=128, linear_key_head_dim=64, linear_value_head_dim=64,
           linear_num_key_heads=8, linear_num_value_heads=16, num_experts=32, num_experts_per_tok=4,
           moe_intermediate_size=256, shared_expert_intermediate_size=512, intermediate_size=2816)


def checkpoint(size: str, directory: Path) -> Path:
    # without the preset's MTP module: nothing here drafts, and its config must not promise tensors
    cfg = dict(MID if size == "mid" else PRESETS["tiny-qwen3-next"], mtp_num_hidden_layers=0)
    write_checkpoint(directory, cfg, random_weights(cfg, 0))
    return directory


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_rows(path: Path, batches, args) -> list[dict]:
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = reference.config.vocab_size
    rows = []
    with LLM(EngineConfig(model=str(path), kv=KVConfig(tokens_per_block=BLOCK, capacity_tokens=16384),
                          max_num_seqs=max(batches))) as llm:
        for batch in batches:
            rng = random.Random(batch)
            prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(batch)]
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
            llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            tpot = []
            for _ in range(args.repeats):
                outs = llm.generate(prompts, params)
                tpot.append(sorted(o.metrics["tpot_s"] for o in outs)[len(outs) // 2])
            ids = torch.tensor(prompts)

            def hf(n: int):
                with torch.inference_mode():
                    reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)

            hf(2)  # warm-up
            hf_tpot = (best(lambda: hf(args.output_len), args.repeats) - best(lambda: hf(1), args.repeats)) \
                / (args.output_len - 1)
            rows.append(dict(batch=batch, specray_ms=min(tpot) * 1e3, transformers_ms=hf_tpot * 1e3,
                             speedup=hf_tpot / min(tpot)))
    return rows


class ModelSteps:
    """The target model on one rank with its own pools, B sequences prefilled to ``context``."""

    def __init__(self, path: Path, batch: int, k: int, context: int):
        self.model = load_model(path, DistContext.single("cpu"), "float32")
        arch, layout = self.model.arch, self.model.state_layout
        self.batch, self.k, self.context = batch, k, context
        blocks_per_seq = -(-(context + k + 1) // BLOCK)
        kv = self.model.kv_layout
        pages = [torch.zeros(batch * blocks_per_seq, 2, kv.num_kv_heads, BLOCK, kv.head_dim)
                 for _ in arch.kv_layers]
        self.state = allocate_state_pool(StateGeometry(layout=layout, num_slots=batch * (1 + k)), torch.device("cpu"))
        self.pools = self.model.layer_pools(pages, self.state)
        self.tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
        self.rows = [b * (1 + k) for b in range(batch)]
        vocab = arch.vocab_size
        self.prompt = torch.randint(0, vocab, (batch * context,))
        self.forward([0] * batch, [context] * batch, self.prompt)

    def forward(self, starts, lens, ids, num_drafts=()):
        positions, meta = build_metadata(self.tables, BLOCK, starts, lens, torch.device("cpu"))
        meta.state_rows, meta.num_drafts = list(self.rows), list(num_drafts)
        with torch.inference_mode():
            return self.model.logits(self.model(ids, positions, self.pools, meta))

    def plain(self):
        self.forward([self.context] * self.batch, [1] * self.batch, self.prompt[:self.batch])

    def verify(self, rng: random.Random):
        n = self.k + 1
        self.forward([self.context] * self.batch, [n] * self.batch, self.prompt[:self.batch * n], [self.k] * self.batch)
        states = [self.pools[i] for i in self.model.arch.linear_layers]
        commit_accepted(states, self.rows, [self.k] * self.batch, [rng.randint(0, self.k) for _ in self.rows])


def verify_rows(path: Path, batches, ks, args) -> list[dict]:
    rows = []
    for batch in batches:
        for k in ks:
            steps = ModelSteps(path, batch, k, args.context)
            rng = random.Random(k)
            steps.plain(), steps.verify(rng)  # warm-up
            plain = best(steps.plain, args.repeats)
            verify = best(lambda: steps.verify(rng), args.repeats)
            rows.append(dict(batch=batch, k=k, plain_ms=plain * 1e3, verify_ms=verify * 1e3, ratio=verify / plain,
                             **scheme_costs(steps, args.repeats)))
    return rows


def scheme_costs(steps: ModelSteps, repeats: int) -> dict:
    """Per step over all linear layers: snapshot's extra work against replay's (module docstring)."""
    model, (batch, k) = steps.model, (steps.batch, steps.k)
    layer = model.layers[model.arch.linear_layers[0]].linear_attn
    num_linear, dk, dv = len(model.arch.linear_layers), layer.lin.k_head_dim, layer.lin.v_head_dim
    heads_k, heads_v, n = layer.num_k_heads, layer.num_v_heads, k + 1
    q, kk = torch.randn(batch, n, heads_k, dk), torch.randn(batch, n, heads_k, dk)
    v, g, beta = torch.randn(batch, n, heads_v, dv), -torch.rand(batch, n, heads_v), torch.rand(batch, n, heads_v)
    state, scratch = steps.state.recurrent[0], torch.tensor(steps.rows)
    initial = state[scratch]
    snap_rows = (scratch[:, None] + 1 + torch.arange(k)).reshape(-1)

    def rule(all_states: bool, length: int = n):
        return recurrent_gated_delta_rule(q[:, :length], kk[:, :length], v[:, :length], g[:, :length],
                                          beta[:, :length], initial_state=initial, l2_normalize_qk=True,
                                          return_all_states=all_states)

    def snapshot():
        _, after = rule(True)
        state[scratch] = after[:, -1]
        state[snap_rows] = after[:, :-1].reshape(-1, *state.shape[1:])

    def final_only():
        _, after = rule(False)
        state[scratch] = after

    conv_in = torch.randn(batch, layer.conv_dim, layer.lin.conv_kernel_size - 1 + n)

    def replay():  # the recurrent rule and the conv again over the accepted n + 1 of k + 1 tokens, on average
        length = max(1, round((k + 2) / 2))
        rule(False, length)
        F.conv1d(conv_in[:, :, :layer.lin.conv_kernel_size - 1 + length], layer.conv_weight, groups=layer.conv_dim)

    torch.manual_seed(0)
    with torch.inference_mode():
        extra = best(snapshot, repeats) - best(final_only, repeats)
        commit = best(lambda: commit_accepted([steps.pools[model.arch.linear_layers[0]]], steps.rows,
                                              [k] * batch, [0] * batch), repeats)
        again = best(replay, repeats)
    return dict(snapshot_ms=num_linear * (max(extra, 0.0) + commit) * 1e3, replay_ms=num_linear * again * 1e3)


DECODE_COLUMNS = [("batch", "batch", "d"), ("specray_ms", "specray TPOT ms", ".2f"),
                  ("transformers_ms", "transformers TPOT ms", ".2f"), ("speedup", "specray x", ".2f")]
VERIFY_COLUMNS = [("batch", "batch", "d"), ("k", "k", "d"), ("plain_ms", "plain step ms", ".2f"),
                  ("verify_ms", "verify + commit ms", ".2f"), ("ratio", "verify / plain", ".2f"),
                  ("snapshot_ms", "snapshot extra ms", ".3f"), ("replay_ms", "replay extra ms", ".3f")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["tiny", "mid"], default="mid")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--ks", default="1,3,7")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batches, ks = [int(b) for b in args.batches.split(",")], [int(k) for k in args.ks.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.size, Path(tmp))
        decode = decode_rows(path, batches, args)
        verify = verify_rows(path, batches, ks, args)
    print(f"plain decode, {args.size} Qwen3-Next-shaped checkpoint, float32, {torch.get_num_threads()} threads")
    print(format_table(decode, DECODE_COLUMNS))
    print(f"\nverify step with its state commit, context {args.context}")
    print(format_table(verify, VERIFY_COLUMNS))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(size=args.size, args=vars(args) | {"json": str(args.json)},
                                             decode=decode, verify=verify), indent=2))


if __name__ == "__main__":
    main()
