"""The local launcher builds and steps its rank on the loop thread (launch/local.py).

One thread running every torch op and CPU kernel of the engine keeps the process at one
OpenMP pool (see the module docstring); a start-up error still reaches the caller as raised."""

from __future__ import annotations

import threading
import time

import pytest
from checkpoints import make_checkpoint
from safetensors.torch import load_file, save_file

import specray.launch.local as local
from specray import LLM, EngineConfig, KVConfig, SamplingParams


def test_the_loop_thread_builds_and_steps_the_rank(monkeypatch):
    seen = {"init": set(), "execute": set()}

    class RecordingWorker(local.RankWorker):
        def __init__(self, *args, **kwargs):
            seen["init"].add(threading.get_ident())
            super().__init__(*args, **kwargs)

        def execute(self, plan):
            seen["execute"].add(threading.get_ident())
            return super().execute(plan)

    monkeypatch.setattr(local, "RankWorker", RecordingWorker)
    with LLM(EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))
        loop = llm._engine._thread.ident
    assert len(out[0].token_ids) == 5
    assert seen == {"init": {loop}, "execute": {loop}} and loop != threading.get_ident()


def test_a_start_up_error_reaches_the_caller_as_raised(tmp_path):
    path = make_checkpoint("llama", tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight"]  # the rank fails while loading the weights
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="has no tensor 'model.layers.0.mlp.down_proj.weight'"):
        LLM(EngineConfig(model=str(path), kv=KVConfig(tokens_per_block=16, capacity_tokens=1024)))
    deadline = time.monotonic() + 10.0  # the loop thread ends right after it hands over the error
    while [t for t in threading.enumerate() if t.name == "specray-engine-loop"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "specray-engine-loop"]


@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
def test_close_frees_the_weights_and_pools_at_once(spec):
    """The caller's process lives on after close: its KV pools (up to cpu_max_bytes each by
    default) and weights must go then, not at the garbage collector's next full pass. The
    engine's driver and client refer to each other, so without the release they outlive close
    (the test suite once grew to 18 GB that way)."""
    import gc
    import weakref

    from specray import SpecConfig

    spec_config = SpecConfig(method=spec, num_draft_tokens=2,
                             draft_model="tiny-llama" if spec == "draft_model" else None) if spec else SpecConfig()
    gc.disable()  # the collector must not be what frees them
    try:
        llm = LLM(EngineConfig(model="tiny-llama", spec=spec_config,
                               kv=KVConfig(tokens_per_block=16, capacity_tokens=1024)))
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        worker = llm._engine.worker
        held = [weakref.ref(t) for t in (*worker.pools, *worker.draft_pools, next(worker.model.parameters()))]
        assert len(held) > 1
        llm.close()
        del worker
        assert [ref() is None for ref in held] == [True] * len(held)
    finally:
        gc.enable()
