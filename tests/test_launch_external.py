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
    assert [r["gloo_threads_after_close"] for r in results] == [[], []]


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
    assert [r["gloo_threads_after_close"] for r in results] == [[], []]


def test_torchrun_dash_m_specray_generate(tiny_checkpoints):
    """`torchrun --nproc-per-node 2 -m specray generate ...` picks the external launcher by
    itself, shards over both ranks, and only rank 0 prints."""
    model = tiny_checkpoints("llama")
    prompt = [5, 6, 7, 8, 9]
    with LLM(EngineConfig(model=str(model), kv=KVConfig(capacity_tokens=512))) as llm:
        from specray import SamplingParams

        expected = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    cmd = TORCHRUN + ["--standalone", "--nproc-per-node", "2", "-m", "specray", "generate", "--model", str(model),
                      "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "12", "--ignore-eos",
                      "--kv-capacity-tokens", "512"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    id_lines = [line for line in done.stdout.splitlines() if line.startswith("output ids:")]
    assert id_lines == ["output ids: " + ",".join(map(str, expected))]  # once: rank 0 only
    assert done.stdout.count("target pool:") == 1


def test_mpirun_style_variables_without_torchrun_run_generate_on_two_ranks(tiny_checkpoints):
    """What mpirun or srun wrappers start: every process gets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT but no TORCHELASTIC_RUN_ID. ``specray generate`` must take the
    job's world size as --tp and the external launcher, as under torchrun."""
    model = tiny_checkpoints("llama")
    prompt = [5, 6, 7, 8, 9]
    with LLM(EngineConfig(model=str(model), kv=KVConfig(capacity_tokens=512))) as llm:
        from specray import SamplingParams

        expected = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    port = _free_port()  # rank 0 hosts the store there (env:// rendezvous)
    procs = []
    for rank in range(2):
        env = {k: v for k, v in _env().items() if not k.startswith("TORCHELASTIC_")}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "specray", "generate", "--model", str(model), "--prompt-ids",
               ",".join(map(str, prompt)), "--max-tokens", "12", "--ignore-eos", "--kv-capacity-tokens", "512"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two ranks did not finish in time")
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    assert [line for line in outs[0].splitlines() if line.startswith("output ids:")] == [
        "output ids: " + ",".join(map(str, expected))]
    assert outs[0].count("target pool:") == 1 and outs[1] == ""  # rank 0 speaks, rank 1 is silent
