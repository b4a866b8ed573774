"""Benchmarks: `python -m benchmarks.run_all` (or `make bench`); results go to bench-results/."""
