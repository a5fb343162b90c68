"""Benchmarks on the machine at hand: `handoff bench ...` (results go in docs/PERF.md)."""
