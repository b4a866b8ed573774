"""Shared by the hybrid-target tests (Qwen3-Next, Kimi Linear): the engine config they run and
the check that no state slot, page or sequence is left behind once the engine is idle."""

from __future__ import annotations

from specray import EngineConfig, KVConfig, ParallelConfig


def hybrid_config(directory, tp: int = 1, **kw) -> EngineConfig:
    """16-token pages, 2048 tokens of KV, 8 sequences; TP > 1 runs under mp."""
    kv = kw.pop("kv", KVConfig(tokens_per_block=16, capacity_tokens=2048))
    return EngineConfig(model=str(directory), kv=kv, max_num_seqs=kw.pop("max_num_seqs", 8),
                        parallel=ParallelConfig(tp_size=tp, launcher="mp" if tp > 1 else "local", timeout_s=60.0),
                        **kw)


def assert_no_slot_held(llm) -> None:
    """Every state slot and page free, nothing running or waiting (rank 0's snapshot: any launcher)."""
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert set(stats.kv_usage) >= {"target", "state"} and set(stats.kv_usage.values()) == {0.0}, stats.kv_usage
