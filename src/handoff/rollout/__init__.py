"""The built-in rollout engine: paged KV, prefix cache, continuous batching, sleep/wake.

    from handoff.rollout.engine import Engine
    from handoff.rollout.sampling import SamplingParams

Files: engine.py (build, generate; its parts kv_pool.py: the pool's size and growth, and
sleep_wake.py: sleep/wake, load_weights), scheduler.py (prefill/decode steps,
preemption), blocks.py (paged KV blocks + prefix cache), runner.py (inputs, forward,
sampling), attention.py (paged attention, backend choice), sampling.py, sequence.py,
layers.py, models/ (Qwen3 / Qwen2 / Llama), kernels/ (Triton). The engine's host-side bench is handoff.bench.host_step.
Nothing is imported here, so `handoff.rollout.kernels` loads without the engine.
"""
