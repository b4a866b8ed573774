"""`make bench`: every benchmark, results under bench-results/ (gitignored).

1. specray against transformers on mid-llama, batch 1 and 8, with the bandwidth roofline;
2. the plain-decoding sweep of `specray bench` on mid-llama, batch 1, 2, 4, 8;
3. speculative decoding on mid-llama (bench_spec --quick: draft_model and dflash, TP 1 and 2);
4. the one-shot all-reduce against gloo, and mid-llama decoding with each all-reduce;
5. TP=1 against TP=2 under mp, and the control channel's cost per step.
"""

from __future__ import annotations

import sys

from benchmarks import bench_allreduce, bench_ranks, bench_spec, bench_vs_transformers
from specray import cli


def main() -> int:
    bench_vs_transformers.main([])
    print()
    code = cli.main(["bench", "--model", "mid-llama", "--input-len", "128", "--output-len", "128",
                     "--batch-sizes", "1,2,4,8", "--json", "bench-results/plain_mid-llama.json"])
    print()
    code = code or bench_spec.main(["--tp", "1,2", "--plot", "bench-results/spec_mid-llama.png"])
    print()
    code = code or bench_allreduce.main([])
    print()
    return code or bench_ranks.main(["--tp1-threads", "1"])


if __name__ == "__main__":
    sys.exit(main())
