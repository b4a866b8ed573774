"""``mp`` from code with no ``if __name__ == "__main__":`` guard: a plain script and ``python -c``.

Ranks come from the rank server (a ``python -m`` process), so the user's ``__main__`` never
runs in them: the script's top-level print appears exactly once, and the TP=2 tokens equal
one rank's. Before the rank server, multiprocessing re-ran the script in every rank, which
then died in its bootstrap ("start-up failed: rank ... died").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specray import LLM, EngineConfig, KVConfig, SamplingParams

PROGRAM = """\
import sys
from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams
print("top-level line", flush=True)
llm = LLM(EngineConfig(model=sys.argv[1], kv=KVConfig(capacity_tokens=256),
                       parallel=ParallelConfig(tp_size=2, launcher="mp", timeout_s=60)))
print("tokens", llm.generate([[1, 2, 3], [40, 41]], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids,
      flush=True)
llm.close()
print("closed", flush=True)
"""


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _expected(model) -> str:
    with LLM(EngineConfig(model=str(model), kv=KVConfig(capacity_tokens=256))) as llm:
        out = llm.generate([[1, 2, 3], [40, 41]], SamplingParams(max_tokens=5, ignore_eos=True))
    return f"tokens {out[0].token_ids}"


def _check(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines == ["top-level line", expected, "closed"], result.stdout  # each once, nothing from the ranks
    assert "bootstrapping" not in result.stderr and "__main__" not in result.stderr


def test_unguarded_script_runs_under_mp_once(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints("llama")
    script = tmp_path / "plain_script.py"
    script.write_text(PROGRAM)
    _check(_run([str(script), str(model)], tmp_path), _expected(model))


def test_python_dash_c_runs_under_mp(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints("llama")
    _check(_run(["-c", PROGRAM, str(model)], tmp_path), _expected(model))
