"""An SPMD script for the external-launcher tests: every torchrun process runs it unchanged.

argv: model, tp_size, out_dir. Each rank writes its outputs to out_dir/rank<R>.json."""

import json
import os
import sys
from pathlib import Path

from specray import LLM, EngineConfig, KVConfig, ParallelConfig, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _thread_names() -> set[str]:
    return {Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")}


def main() -> None:
    model, tp, out_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    config = EngineConfig(model=model, kv=KVConfig(capacity_tokens=512),
                          parallel=ParallelConfig(tp_size=tp, launcher="external", check_every_step=True,
                                                  timeout_s=30))
    with LLM(config) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        try:  # a bad request fails on every rank with rank 0's error, and the job goes on
            llm.generate([[]], PARAMS)
            rejected = ""
        except ValueError as e:
            rejected = str(e)
        again = llm.generate(PROMPTS[:1], PARAMS)
        transport = llm._engine.session.channel.transport  # which path the plans took to this rank
        result = dict(rank=llm.rank, tokens=[o.token_ids for o in outs], again=again[0].token_ids,
                      rejected=rejected, transport=transport)
    # closing joined torch's own threads (gloo's workers): left for interpreter exit, one
    # still finishing a collective would take the GIL there, and that aborts the process
    result["gloo_threads_after_close"] = sorted(n for n in _thread_names() if "gloo" in n)
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
