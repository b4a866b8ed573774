"""specray against transformers' ``generate`` on the same weights, in the same run.

    python -m benchmarks.bench_vs_transformers [--model smollm2-135m|mid-llama|tiny-deepseek-v3|tiny-qwen3-next]
        [--batch-sizes 1,8]

``smollm2-135m`` (the default) is the built-in real model: both sides load the same GGUF file
(transformers dequantizes it to float32, as specray does) and run the same chat-formatted
HumanEval prompts cut to exactly ``--input-len`` tokens (equal lengths: transformers needs no
padding). ``mid-llama`` is the random-weight preset (156M parameters) with random prompts;
``tiny-deepseek-v3`` / ``tiny-kimi-k2`` the MLA presets (DeepseekV3ForCausalLM on both sides), for
which the report adds the target pool's bytes per token beside tiny-llama's (a GQA preset of the
same width: hidden 256, 4 layers, 8 heads); ``tiny-qwen3-next`` the hybrid preset
(Qwen3NextForCausalLM on both sides: transformers runs its torch fallbacks of the delta rule and
the conv, as specray runs its own).
Greedy, exactly ``output_len`` new tokens on both sides (transformers: no EOS in its
generation config; specray: ``ignore_eos``): EOS may be generated and does not stop either.

The machine may be shared, so the two sides alternate: each of ``--repeats`` rounds runs
specray, then transformers, then the GEMV probe, and the fastest run of each counts (the one
least disturbed by other processes).

Reported per batch size: end-to-end tok/s (batch * output_len / wall time of one generate
call), TTFT and decode time per token. transformers has no per-token timestamps, so its TTFT
is timed as a separate ``max_new_tokens=1`` call and its TPOT is (total - TTFT) / (output_len - 1).
``CPU-time speedup`` = transformers CPU s / specray CPU s over the same call.

The floor: a batch-1 decode step reads every weight once. ``torch.mv`` over float32 tensors of
every weight shape of the model (one embedding row aside), timed in the same run, is the step
time the machine's GEMV gives; on this machine a GEMV pass reads at ~14-16 GB/s while a plain
copy reports ~40-48 GB/s, so the copy bandwidth would be a floor no matrix-vector code reaches.
The printed percentage is GEMV floor / specray's batch-1 TPOT.

Targets: smollm2-135m batch 1 >= 1.5x transformers, batch 8 >= 2x; mid-llama 1.0x and 1.5x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

from benchmarks.prompts import chat_prompts_of_length
from specray import LLM, EngineConfig, KVConfig, SamplingParams
from specray.bench import BenchConfig, format_table, measure_batch, random_prompts
from specray.models.arch import ModelArch
from specray.models.loader import read_model_arch
from specray.models.presets import is_preset, resolve_model
from specray.models.tokenizer import load_tokenizer

TARGETS = {"smollm2-135m": {1: 1.5, 8: 2.0}, "mid-llama": {1: 1.0, 8: 1.5},  # specray / transformers tok/s
           "tiny-deepseek-v3": {}, "tiny-kimi-k2": {},  # MLA presets: measured, no target set
           "tiny-qwen3-next": {}}  # the hybrid preset (Gated DeltaNet + gated attention): measured, no target set
GQA_OF_SAME_WIDTH = {"tiny-deepseek-v3": "tiny-llama", "tiny-kimi-k2": "tiny-llama"}
"""For MLA models, the GQA preset of the same width (hidden 256, 4 layers, 8 heads) whose pool
bytes per token the report sets beside the latent pool's."""

COLUMNS = [
    ("batch", "batch", "d"),
    ("specray_tok_s", "specray tok/s", ".1f"),
    ("hf_tok_s", "HF tok/s", ".1f"),
    ("speedup", "speedup", ".2f"),
    ("target", "target", ".1f"),
    ("cpu_speedup", "CPU-time speedup", ".2f"),
    ("specray_tpot_ms", "specray TPOT ms", ".2f"),
    ("hf_tpot_ms", "HF TPOT ms", ".2f"),
    ("specray_ttft_ms", "specray TTFT ms", ".1f"),
    ("hf_ttft_ms", "HF TTFT ms", ".1f"),
    ("token_match", "same tokens", ".2f"),
]


def weight_shapes(arch: ModelArch) -> list[tuple[int, int]]:
    """The [out, in] shape of every matrix a batch-1 decode step multiplies by (the LM head
    included; the embedding is a row lookup)."""
    if arch.mla is not None:
        return mla_weight_shapes(arch)
    if arch.linear is not None:
        return hybrid_weight_shapes(arch)
    h, hd = arch.hidden_size, arch.head_dim
    layer = [(arch.num_heads * hd, h), (arch.num_kv_heads * hd, h), (arch.num_kv_heads * hd, h),
             (h, arch.num_heads * hd), (arch.intermediate_size, h), (arch.intermediate_size, h),
             (h, arch.intermediate_size)]
    return layer * arch.num_layers + [(arch.vocab_size, h)]


def hybrid_weight_shapes(arch: ModelArch) -> list[tuple[int, int]]:
    """Qwen3-Next: per linear layer in_proj_qkvz, in_proj_ba, out_proj; per full layer q_proj (q and
    gate), k, v, o; per MoE layer the router, top-k experts and the shared expert and its gate."""
    h, hd, lin = arch.hidden_size, arch.head_dim, arch.linear
    shapes = []
    for i in range(arch.num_layers):
        if arch.mixer_of(i) == "linear_attention":
            shapes += [(2 * lin.key_dim + 2 * lin.value_dim, h), (2 * lin.num_v_heads, h), (h, lin.value_dim)]
        else:
            shapes += [(2 * arch.num_heads * hd, h), (arch.num_kv_heads * hd, h), (arch.num_kv_heads * hd, h),
                       (h, arch.num_heads * hd)]
        inter, shared = arch.moe_intermediate_size, arch.shared_expert_intermediate_size
        if i in arch.moe_layers:
            shapes += [(arch.num_experts, h), (1, h)] + [(inter, h), (inter, h), (h, inter)] * arch.num_experts_per_tok
            shapes += [(shared, h), (shared, h), (h, shared)]
        else:
            shapes += [(arch.intermediate_size, h), (arch.intermediate_size, h), (h, arch.intermediate_size)]
    return shapes + [(arch.vocab_size, h)]


def mla_weight_shapes(arch: ModelArch) -> list[tuple[int, int]]:
    """MLA layers' matrices, and per MoE layer the router, the top-k routed experts a batch-1
    token reads and the shared experts (the experts not chosen are not read)."""
    m, h, heads = arch.mla, arch.hidden_size, arch.num_heads
    q_out = heads * m.qk_head_dim
    q = [(q_out, h)] if m.q_lora_rank is None else [(m.q_lora_rank, h), (q_out, m.q_lora_rank)]
    kv_b = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    attn = q + [(m.latent_dim, h), kv_b, (h, heads * m.v_head_dim)]
    shapes = []
    for i in range(arch.num_layers):
        if i in arch.moe_layers:
            inter = arch.moe_intermediate_size
            mlp = [(arch.num_experts, h)] + [(inter, h), (inter, h), (h, inter)] * arch.num_experts_per_tok
            shared = inter * arch.router.num_shared_experts
            mlp += [(shared, h), (shared, h), (h, shared)] if shared else []
        else:
            mlp = [(arch.intermediate_size, h), (arch.intermediate_size, h), (h, arch.intermediate_size)]
        shapes += attn + mlp
    return shapes + [(arch.vocab_size, h)]


def pool_bytes_per_token(model: str) -> dict:
    """The target pool as the engine allocates it (one rank, float32): bytes per token and kind."""
    with LLM(EngineConfig(model=model, kv=KVConfig(capacity_tokens=1024))) as llm:
        g = llm.geometry["target"]
    return dict(model=model, kind=g.kind, bytes_per_token=g.num_bytes // g.capacity_tokens, num_layers=g.num_layers,
                row=f"{g.num_kv_heads} x {g.head_dim}" + (" (K and V)" if g.kind == "kv" else ""))


def gemv_floor_ms(shapes: list[tuple[int, int]], repeats: int = 5) -> tuple[float, int]:
    """The fastest of ``repeats`` passes of ``torch.mv`` over float32 matrices of ``shapes``, on the
    current torch threads; and the bytes one pass reads."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) for shape in shapes]
    vectors = {cols: torch.randn(cols, generator=gen) for _, cols in shapes}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            torch.mv(w, vectors[w.shape[1]])
        best = min(best, time.perf_counter() - start)
    return best * 1e3, sum(w.numel() * 4 for w in weights)


@torch.inference_mode()
def _hf_generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         pad_token_id=0)
    return out[:, ids.shape[1]:], time.perf_counter() - start


def load_transformers(path: Path):
    import transformers

    if path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.temperature = model.generation_config.top_p = None  # greedy: silence sampling warnings
    # Run to max_new_tokens as specray's ignore_eos does: EOS may be generated and does not stop.
    # (min_new_tokens would instead forbid EOS until then and so change the tokens.)
    model.generation_config.eos_token_id = None
    return model.eval()


def measure_transformers(model, prompts: list[list[int]], bench: BenchConfig) -> dict:
    """One timed run: TTFT from a one-token call, then the full-length call."""
    ids = torch.tensor(prompts)
    for _ in range(bench.warmup):
        _hf_generate(model, ids, min(bench.output_len, 8))
    _, ttft = _hf_generate(model, ids, 1)
    start_cpu = time.process_time()
    tokens, wall = _hf_generate(model, ids, bench.output_len)
    cpu_s = time.process_time() - start_cpu
    # Derived from two separate calls: when other processes slow the one-token call more than
    # the full one, the difference is meaningless, and is reported as NaN rather than negative.
    tpot = (wall - ttft) / (bench.output_len - 1) if wall > ttft else float("nan")
    return dict(total_tok_s=len(prompts) * bench.output_len / wall, wall_s=wall, cpu_s=cpu_s, ttft_ms=ttft * 1e3,
                tpot_ms=tpot * 1e3, tokens=tokens.tolist())


def run_both(model: str, prompts: dict[int, list[list[int]]], bench: BenchConfig, repeats: int,
             floors: list[float]) -> tuple[dict[int, dict], dict[int, dict]]:
    """For each batch size, ``repeats`` rounds of (specray, transformers, GEMV floor), so both
    sides meet the same load from other processes; the fastest run of each side counts."""
    capacity = max(len(p) for p in prompts.values()) * (bench.input_len + bench.output_len)
    config = EngineConfig(model=model, kv=KVConfig(tokens_per_block=16, capacity_tokens=capacity))
    path = resolve_model(model)
    hf_model = load_transformers(path)
    shapes = weight_shapes(read_model_arch(path))
    spec, hf = {}, {}
    with LLM(config) as llm:
        for name, geometry in llm.geometry.items():
            print(geometry.describe(name))
        for batch, batch_prompts in prompts.items():
            spec_runs, hf_runs = [], []
            for i in range(repeats):
                round_bench = bench if i == 0 else dataclasses.replace(bench, warmup=0)
                row, outs = measure_batch(llm, batch_prompts, round_bench, SamplingParams())
                spec_runs.append(dict(row, tokens=[o.token_ids for o in outs]))
                hf_runs.append(measure_transformers(hf_model, batch_prompts, round_bench))
                floors.append(gemv_floor_ms(shapes)[0])
                print(f"batch {batch} round {i}: specray {row['total_tok_s']:.1f} tok/s (TPOT {row['tpot_p50_ms']:.2f}"
                      f" ms), transformers {hf_runs[-1]['total_tok_s']:.1f} tok/s (TPOT {hf_runs[-1]['tpot_ms']:.2f}"
                      f" ms), GEMV floor {floors[-1]:.2f} ms", flush=True)
            spec[batch] = min(spec_runs, key=lambda r: r["wall_s"])
            hf[batch] = min(hf_runs, key=lambda r: r["wall_s"])
    return spec, hf


def compare(model: str, spec: dict[int, dict], hf: dict[int, dict]) -> list[dict]:
    rows = []
    for batch in spec:
        s, h = spec[batch], hf[batch]
        pairs = [(a, b) for sa, ha in zip(s["tokens"], h["tokens"]) for a, b in zip(sa, ha)]
        rows.append(dict(batch=batch, specray_tok_s=s["total_tok_s"], hf_tok_s=h["total_tok_s"],
                         speedup=s["total_tok_s"] / h["total_tok_s"], target=TARGETS[model].get(batch, float("nan")),
                         cpu_speedup=h["cpu_s"] / s["cpu_s"], specray_cpu_s=s["cpu_s"], hf_cpu_s=h["cpu_s"],
                         specray_tpot_ms=s["tpot_p50_ms"], hf_tpot_ms=h["tpot_ms"],
                         specray_ttft_ms=s["ttft_p50_ms"], hf_ttft_ms=h["ttft_ms"],
                         token_match=sum(a == b for a, b in pairs) / len(pairs)))
    return rows


def build_prompts(model: str, bench: BenchConfig) -> dict[int, list[list[int]]]:
    """Chat-formatted HumanEval prompts for a model with a tokenizer and chat template; random
    token ids for the random-weight presets."""
    path = resolve_model(model)
    if not is_preset(model):
        tokenizer = load_tokenizer(path)
        return {b: chat_prompts_of_length(tokenizer, b, bench.input_len) for b in bench.batch_sizes}
    vocab_size = read_model_arch(path).vocab_size
    return {b: random_prompts(b, bench.input_len, vocab_size, seed=b) for b in bench.batch_sizes}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(TARGETS))
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per side and batch; the fastest counts")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: torch's choice); 1 makes CPU time a fair "
                             "measure of work on a shared machine")
    parser.add_argument("--json", default=None, help="default: bench-results/bench_vs_transformers_MODEL.json")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    bench = BenchConfig(input_len=args.input_len, output_len=args.output_len, warmup=args.warmup,
                        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")))
    prompts = build_prompts(args.model, bench)
    load_before = os.getloadavg()[0]  # other processes' load: how far to trust the timings
    floors: list[float] = []
    spec, hf = run_both(args.model, prompts, bench, args.repeats, floors)
    rows = compare(args.model, spec, hf)
    floor_ms, floor_bytes = min(floors), gemv_floor_ms(weight_shapes(read_model_arch(resolve_model(args.model))), 1)[1]
    tpot1 = spec[min(spec)]["tpot_p50_ms"]
    floor = dict(gemv_floor_ms=floor_ms, weight_bytes=floor_bytes, gemv_gb_s=floor_bytes / floor_ms / 1e6,
                 achieved_tpot_ms=tpot1, fraction_of_floor=floor_ms / tpot1)
    load = (load_before, os.getloadavg()[0])
    print(f"\n{args.model} float32, input {bench.input_len}, output {bench.output_len}, one run; 1-min load average "
          f"{load[0]:.1f} before, {load[1]:.1f} after on {os.cpu_count()} CPUs (a load above the CPU count makes timings noisy)")
    print(format_table(rows, COLUMNS))
    print(f"batch-{min(spec)} decode: {tpot1:.2f} ms/token vs the GEMV floor {floor_ms:.2f} ms (torch.mv over "
          f"{floor_bytes / 1e6:.0f} MB of weight shapes, {floor['gemv_gb_s']:.1f} GB/s) = "
          f"{floor['fraction_of_floor']:.0%} of the floor")
    report = dict(model=args.model, dtype="float32", bench=dict(input_len=bench.input_len, output_len=bench.output_len,
                  warmup=bench.warmup, repeats=args.repeats), rows=rows, gemv_floor=floor,
                  machine=dict(cpu_count=os.cpu_count(), load_average_before_after=load,
                               torch_threads=torch.get_num_threads(),
                               torch=torch.__version__, platform=platform.platform()))
    if args.model in GQA_OF_SAME_WIDTH:  # the reason MLA exists: KV bytes per token
        pools = [pool_bytes_per_token(args.model), pool_bytes_per_token(GQA_OF_SAME_WIDTH[args.model])]
        report["pool_bytes_per_token"] = pools
        for p in pools:
            print(f"{p['model']}: {p['kind']} pool, {p['bytes_per_token']} bytes/token "
                  f"({p['num_layers']} layers of {p['row']} float32)")
        print(f"MLA / GQA of the same width: {pools[0]['bytes_per_token'] / pools[1]['bytes_per_token']:.3f}")
    path = Path(args.json or f"bench-results/bench_vs_transformers_{args.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
