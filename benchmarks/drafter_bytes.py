"""What a drafting step should cost: the drafter's weight bytes read per speculative step, over
the memory bandwidth measured in the same run (benchmarks only).

bench_spec's first ideal takes the drafter's *measured* step time, so a slow drafter looks
efficient there. This one takes the time its bytes say. A batch-1 draft forward is a GEMV per
weight, so it reads every weight it touches once:

    draft bytes per step = forwards per step * (drafter weight bytes + LM-head bytes)
    ideal (bytes)        = AL * t_plain_step / (draft bytes / bandwidth + t_verify)

- forwards per step: k for the autoregressive drafters (draft_model, eagle3, mtp: one draft
  per forward), 1 for the block drafters (dflash, dspark: k drafts from one forward);
- the drafter's own tensors count whole except its token embedding, which is read one row per
  token, not whole;
- the LM head is the drafter's own where its checkpoint has one (`lm_head.weight`), else the
  target's (`lm_head.weight`, or the embedding when the target ties them).

Verify keeps its measured time: this column is about the drafter. ngram reads no weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

BLOCK_DRAFTERS = {"dflash", "dspark"}  # k drafts from one forward
AUTOREGRESSIVE = {"draft_model", "eagle3", "mtp"}  # one draft per forward

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def tensor_bytes(checkpoint: Path) -> dict[str, int]:
    """name -> bytes of every tensor in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                numel = 1
                for dim in part.get_shape():
                    numel *= dim
                out[name] = numel * _DTYPE_BYTES[part.get_dtype()]
    return out


def is_embedding(name: str) -> bool:
    return name.endswith("embed_tokens.weight")


def head_bytes(tensors: dict[str, int], tied: bool) -> int | None:
    """The LM head's bytes among ``tensors``: lm_head, else the embedding when tied, else None."""
    if "lm_head.weight" in tensors:
        return tensors["lm_head.weight"]
    if tied:
        return next((b for name, b in tensors.items() if is_embedding(name)), None)
    return None


def forwards_per_step(method: str, k: int) -> int:
    """Draft forwards of one speculative step of k drafts (the rule in the module docstring)."""
    if method in BLOCK_DRAFTERS:
        return 1
    if method in AUTOREGRESSIVE:
        return k
    raise ValueError(f"method {method!r} has no drafter weights to count: one of "
                     f"{sorted(BLOCK_DRAFTERS | AUTOREGRESSIVE)} expected")


def draft_step_bytes(method: str, k: int, drafter: dict[str, int], target_head: int) -> int:
    """Weight bytes one batch-1 speculative step's drafting reads (rule in the module docstring)."""
    own = sum(b for name, b in drafter.items() if not is_embedding(name) and name != "lm_head.weight")
    head = drafter.get("lm_head.weight", target_head)
    return forwards_per_step(method, k) * (own + head)


def mtp_tensors(target: dict[str, int], num_layers: int) -> dict[str, int]:
    """The MTP modules' tensors inside a target checkpoint (DeepSeek-V3's ``model.layers.{L}.*``
    after the target's L layers, or Qwen3-Next's ``mtp.*``), a module's own head
    (``shared_head.head``) renamed ``lm_head.weight`` so draft_step_bytes counts it as the head."""
    first = f"model.layers.{num_layers}."
    out = {name: b for name, b in target.items() if name.startswith(first) or name.startswith("mtp.")}
    head = first + "shared_head.head.weight"
    if head in out:
        out["lm_head.weight"] = out.pop(head)
    return out


def checkpoint_draft_bytes(method: str, k: int, drafter_dir: Path, target_dir: Path) -> int:
    """draft_step_bytes for checkpoints on disk (``mtp``: drafter_dir is the target's own)."""
    target = tensor_bytes(target_dir)
    config = json.loads((Path(target_dir) / "config.json").read_text())
    target_head = head_bytes(target, bool(config.get("tie_word_embeddings", False)))
    if target_head is None:
        raise ValueError(f"target checkpoint {target_dir} has neither lm_head.weight nor a tied embedding")
    if method == "mtp":
        drafter = mtp_tensors(target, config["num_hidden_layers"])
    else:
        drafter = tensor_bytes(drafter_dir)
    return draft_step_bytes(method, k, drafter, target_head)


def ideal_from_bytes(acceptance_length: float, plain_step_ms: float, draft_bytes: int, gbps: float,
                     verify_ms: float) -> float:
    """AL * t_plain / (draft bytes over the bandwidth + t_verify): the drafter at its bytes' time."""
    draft_ms = draft_bytes / (gbps * 1e9) * 1e3
    return acceptance_length * plain_step_ms / (draft_ms + verify_ms)


def add_bytes_columns(row: dict, plain_step_ms: float, gbps: float) -> None:
    """A bench_spec row's ``ideal_bytes_speedup`` and ``bytes_efficiency`` (decode x over it)."""
    row["ideal_bytes_speedup"] = ideal_from_bytes(row["acceptance_length"], plain_step_ms, row["draft_bytes"], gbps,
                                                  row["verify_ms"])
    row["bytes_efficiency"] = row["decode_speedup"] / row["ideal_bytes_speedup"]


def measure_gbps(rounds: int = 5, footprint: int = 128 * 2**20, shape: tuple[int, int] = (5632, 1024)) -> float:
    """This process's batch-1 GEMV bandwidth (GB/s of float32 weight read, the fastest of
    ``rounds``) with the kernel specray's decode runs (small_gemm, else F.linear), cycling
    through copies of a mid-llama gate_up weight that together exceed the L3 (bench_gemv's method)."""
    from specray.models.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    gemv = (lambda x, w: kernels.small_gemm(x, w, None)) if kernels is not None else torch.nn.functional.linear
    n, k = shape
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for _ in range(max(2, -(-footprint // (n * k * 4))))]
    x = torch.randn(1, k, generator=gen)
    best = 0.0
    with torch.inference_mode():
        for w in weights:  # warm-up: one whole pass (code, threads, first touch of every copy)
            gemv(x, w)
        for _ in range(rounds):
            start = time.perf_counter()
            for w in weights:
                gemv(x, w)
            best = max(best, len(weights) * n * k * 4 / (time.perf_counter() - start) / 1e9)
    return best
