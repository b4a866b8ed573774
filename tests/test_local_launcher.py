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
