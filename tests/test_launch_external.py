"""The ``external`` launcher under a real torchrun: every process runs tests/spmd_generate.py
unchanged, and every rank must return rank 0's outputs, equal to one rank's tokens.

One run with ``--standalone --nproc-per-node 2`` (plans by shared memory) and one with the
multi-node flags (``--nnodes 2`` on this host, c10d rendezvous): torchrun's node rank keeps
the two "nodes" apart, so the plans cross over the CPU group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specray import LLM, EngineConfig, KVConfig
from spmd_generate import PARAMS, PROMPTS

SCRIPT = Path(__file__).with_name("spmd_generate.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _reference(model) -> dict:
    with LLM(EngineConfig(model=str(model), kv=KVConfig(capacity_tokens=512))) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return dict(tokens=tokens, again=tokens[0], rejected="request 0: the prompt is empty; a prompt needs at least one token")


def _results(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def _check(procs: list[subprocess.Popen], timeout_s: float) -> None:
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("torchrun did not finish in time")
        assert p.returncode == 0, err.decode()[-3000:]


def test_torchrun_standalone_two_ranks(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints("qwen3")
    cmd = TORCHRUN + ["--standalone", "--nproc-per-node", "2", str(SCRIPT), str(model), "2", str(tmp_path)]
    _check([subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)], 240)
    expected = _reference(model)
    results = _results(tmp_path, 2)
    for rank, got in enumerate(results):
        assert got["rank"] == rank
        assert {k: got[k] for k in expected} == expected
    assert [r["transport"] for r in results] == ["shm", "shm"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_multi_node_flags(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints("llama")
    port = _free_port()  # torchrun's own rendezvous needs a port known to both agents
    procs = []
    for node in range(2):
        cmd = TORCHRUN + ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-id", f"specray-test-{port}", str(SCRIPT), str(model), "2", str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    _check(procs, 240)
    expected = _reference(model)
    results = _results(tmp_path, 2)
    for got in results:
        assert {k: got[k] for k in expected} == expected
    assert [r["transport"] for r in results] == ["cpu-group", "cpu-group"]
