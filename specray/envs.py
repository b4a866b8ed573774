"""Environment variables specray reads on each rank (operators and tests set them).

A value applies to every rank, or to chosen ranks with ``rank:value`` items separated by
``;`` (``"1:32"`` narrows rank 1 only; ``"0:0.2;1:0.4"`` gives each rank its own value).

| variable                          | meaning                                                        |
|-----------------------------------|----------------------------------------------------------------|
| SPECRAY_KV_MEMORY_FRACTION        | this rank's kv.memory_fraction                                 |
| SPECRAY_DRAFT_KERNEL_PAGE_SIZES   | narrow this rank's drafter-kernel page sizes (comma list)      |
| SPECRAY_MLA_KERNEL                | an MLA target reports this named MLA decode kernel's page      |
|                                   | sizes (models/mla.py: flashmla, trtllm_gen_mla, cutlass_mla,   |
|                                   | fp4_mla) to the agreement; the rank still computes on the CPU  |
|                                   | path, which takes any page (a GPU deployment's rules, on CPU)  |
| SPECRAY_CPU_MALLOC_TUNING         | 0 keeps glibc's malloc thresholds (see workers/cpu_malloc.py)  |
| SPECRAY_CPU_FUSED_LAYERS          | 0 runs decode steps module by module (models/fused_decode.py)  |
| SPECRAY_CPU_QUANT                 | exact (default) keeps GGUF weights in their blocks on CPU     |
|                                   | ranks, 0 dequantizes them at load (models/quant_weight.py)     |
| SPECRAY_CPU_BARRIER_WAITS         | spin, sleep or auto (default): how OpenMP threads wait at a    |
|                                   | barrier on a CPU rank (workers/barrier_waits.py)               |
| SPECRAY_FAULT_KV_EXTRA_BLOCKS     | testing only: allocate this many extra blocks, which the       |
|                                   | fingerprint check must catch                                   |
| SPECRAY_FAULT_STATE_EXTRA_SLOTS   | testing only: allocate this many extra state rows (hybrid      |
|                                   | targets), which the fingerprint check must catch               |
| SPECRAY_TEST_STEP_DIR             | testing only: after each step, every rank writes its step      |
|                                   | count to ``<dir>/rank<R>.steps`` (a test acts mid-call on it)  |
| SPECRAY_TEST_DRAFTS_DIR           | testing only: every rank appends ``[seq id, tokens, drafts,    |
|                                   | accepted]`` per drafting row to ``<dir>/rank<R>.drafts``       |
| SPECRAY_STARTUP_PROFILE_DIR       | benchmarks: each rank writes its start-up phases to            |
|                                   | ``<dir>/rank<R>.json`` (specray/startup_phases.py)             |

Rank processes started by a launcher (mp's rank server, Ray actors) get the driver's
variables listed by ``forwarded_env``: specray's own, the communication libraries', and
the thread-count knobs. Nothing else of the driver's crosses, so a rank's behaviour does not
depend on what the rank server or the Ray worker happened to inherit.

The allowlist (``FORWARDED_PREFIXES``, ``FORWARDED_NAMES``):

| forwarded                                         | why                                          |
|---------------------------------------------------|----------------------------------------------|
| SPECRAY_*                                         | the per-rank knobs above, SPECRAY_CACHE      |
| NCCL_*, TORCH_NCCL_*, GLOO_*, TORCH_DISTRIBUTED_* | interfaces, timeouts and debug of the groups |
| OMP_NUM_THREADS, MKL_NUM_THREADS                  | an explicit thread count wins over the split |
| TOKENIZERS_PARALLELISM, HF_HUB_OFFLINE            | tokenizer threads; no hub access on ranks    |

Under Ray (possibly on other nodes) they travel in each actor's ``runtime_env["env_vars"]``,
under the user's ``ParallelConfig.runtime_env``, whose own ``env_vars`` win on a clash; any
other variable a rank needs goes there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

FORWARDED_PREFIXES = ("SPECRAY_", "NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
FORWARDED_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE")


# What marks a process started the torchrun way (torchrun, or Slurm/mpirun wrappers that set
# torchrun's variables): its rank, the world size and where rank 0's store is. torchrun's own
# TORCHELASTIC_RUN_ID is not required, so the same job under mpirun or srun is recognised too.
TORCHRUN_MARKERS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env_present(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one rank of a torchrun-style job (every marker variable set):
    the one test behind both ``launcher="auto"`` picking ``external`` and the CLI's default
    ``--tp`` (the job's WORLD_SIZE)."""
    environ = os.environ if environ is None else environ
    return all(name in environ for name in TORCHRUN_MARKERS)


def is_forwarded(name: str) -> bool:
    return name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's variables that every rank process receives (the documented allowlist)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if is_forwarded(k)}


def adopt_forwarded_env(env: dict[str, str], environ=os.environ) -> None:
    """Make this process's forwarded variables exactly the driver's ``env``: a rank forked from a
    long-lived server must not keep one the driver has unset since the server started."""
    for name in [k for k in environ if is_forwarded(k) and k not in env]:
        del environ[name]
    environ.update(env)


def cache_root() -> Path:
    """Where presets and CPU kernel builds are cached: $SPECRAY_CACHE, default ~/.cache/specray."""
    return Path(os.environ.get("SPECRAY_CACHE", Path.home() / ".cache" / "specray"))


def rank_value(name: str, rank: int) -> str | None:
    """The value of ``name`` for ``rank``, or None when it is unset for that rank."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    if ":" not in raw:
        return raw.strip()
    for item in raw.split(";"):
        who, _, value = item.partition(":")
        if who.strip() == str(rank):
            return value.strip()
    return None


def rank_page_sizes(name: str, rank: int) -> frozenset[int] | None:
    value = rank_value(name, rank)
    if value is None:
        return None
    try:
        return frozenset(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r}: page sizes must be integers like '32,64'") from None
