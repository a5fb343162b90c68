"""The pure cost model of a colocated step: imports no torch and no GPU library.

hardware (card + link profiles) -> shapes (N, KV per token) -> ledger (bytes per owner, the
nine switch actions) -> kvpool (KV pool, concurrency, decode, generation time) -> verdict
(hard limits, mode, safe utilization); report.build_plan ties them for `handoff plan`.
"""
