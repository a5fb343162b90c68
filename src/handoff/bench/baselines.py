"""What `handoff bench engine` compares the engine with, and where its decode step's time goes.

* copy_bandwidth: the device-to-device copy rate (bytes read + written), the HBM floor's rate;
* matmul_flops_per_s: a bf16 square matmul's rate, the compute floor's (prefill, training);
* draw_ms: a sampled draw by the torch path and by the one-kernel draw, at a batch size;
* transformers_ms_per_step: transformers `generate` per decode step on the same checkpoint;
* graph_kernel_profile: the kernels one replay of a captured decode graph runs (count and
  device time: matrix products, attention, the rest), from the PyTorch profiler. A step's wall
  time minus its kernel time is launch gaps and host work.
"""

from __future__ import annotations

import gc
import math
import re
import time
from pathlib import Path

import numpy as np
import torch

_GEMM = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk", re.IGNORECASE)
_ATTENTION = re.compile(r"paged_decode|merge_splits|flash|attention", re.IGNORECASE)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def matmul_flops_per_s(dev: torch.device, dtype: torch.dtype, n: int, iters: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (best of `iters` after a warm-up): the
    compute floor's rate."""
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    best = math.inf
    for i in range(iters + 2):
        sync(dev)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(dev)
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def draw_ms(rows: int, vocab: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Device ms of one sampled draw (temperature 1, no truncation) of `rows` rows of random
    logits, by the torch path and by the one-kernel draw (kernels/sampler.py), on the bench's
    own card: the A/B behind sampling.fused_draw_applies."""
    from handoff.rollout.gemm_choice import gpu_seconds
    from handoff.rollout.sampling import SamplerRows, draw

    logits = torch.randn(rows, vocab, device=device).to(dtype)
    inputs = SamplerRows(temperature_B=torch.ones(rows, device=device),
                         uniform_B=torch.rand(rows, device=device, dtype=torch.float64),
                         top_k_B=None, top_p_B=None)
    return {name: 1e3 * gpu_seconds(lambda: draw(logits, inputs, fused=fused), device)
            for name, fused in (("torch", False), ("fused", True))}


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy rate in bytes/s, bytes read plus bytes written (median of 20)."""
    nbytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    free(device)
    return 2 * nbytes / float(np.median(times[5:]))



def transformers_ms_per_step(path: Path, batches: list[int], *, prompt_len: int,
                             new_tokens: int, device: torch.device, dtype: torch.dtype,
                             seed: int = 0) -> dict[int, dict]:
    """transformers `generate` (greedy, EOS suppressed) per decode step at each batch size:
    (time for 1 + n new tokens - time for 1) / n. When the longer run took no longer (a tiny
    model, timing noise), ms_per_step and tokens_per_s are None and `not_measurable` says so."""
    from transformers import AutoModelForCausalLM

    from handoff.modelzoo import PAD_ID

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=False).to(device).eval()
    gen = torch.Generator().manual_seed(seed)

    def timed(ids: torch.Tensor, num: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num, min_new_tokens=num, pad_token_id=PAD_ID)
        sync(device)
        assert out.shape[1] == ids.shape[1] + num, (out.shape, num)
        return time.perf_counter() - start

    timed(torch.randint(0, 256, (1, 8), generator=gen).to(device), 2)  # warm-up
    rows = {}
    for batch in batches:
        ids = torch.randint(0, 256, (batch, prompt_len), generator=gen).to(device)
        one = timed(ids, 1)
        more = timed(ids, 1 + new_tokens)
        if more <= one:   # the new tokens' time is lost in the noise: no number, and why
            rows[batch] = {"ms_per_step": None, "tokens_per_s": None,
                           "new_tokens_timed": new_tokens, "prefill_s": one,
                           "not_measurable": f"1 + {new_tokens} new tokens took {more:.4f} s, "
                                             f"1 took {one:.4f} s"}
            continue
        ms = 1e3 * (more - one) / new_tokens
        rows[batch] = {"ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms,
                       "new_tokens_timed": new_tokens, "prefill_s": one}
    del model
    free(device)
    return rows


def graph_kernel_profile(runner, batch: int, repeats: int = 3) -> dict:
    """Kernels per replay of the decode graphs that serve `batch` rows, and their device ms:
    the model's (matrix products, attention, the rest) and, with graph_sampling, the LM head
    and the sampler's, greedy (`sampler_*`, what the bench's greedy steps replay) and sampled
    (`sampled_sampler_ms`: temperature > 0 without top-k/top-p, an RL rollout's draw).

    Replays the last staged step again (it rewrites the same K/V into the same slots).
    """
    from handoff.rollout.graphs import bucket

    rows = bucket(batch, runner.sizes)
    if runner.graphs is None or rows is None:
        return {}
    try:
        kernels = _replayed_kernels(runner, (rows, "model"), repeats)
        samplers = {part: _replayed_kernels(runner, (rows, part), repeats)
                    for part in ("greedy", "sample") if runner.graphs.has(rows, part)}
    except Exception as e:  # no CUPTI on the machine: the rest of the bench still counts
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    ms = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    counts = dict.fromkeys(ms, 0)
    for event in kernels:
        kind = ("gemm" if _GEMM.search(event.name) else
                "attention" if _ATTENTION.search(event.name) else "other")
        ms[kind] += event.time_range.elapsed_us() / 1e3 / repeats
        counts[kind] += 1
    out = {"graph_rows": rows, "kernels": len(kernels) // repeats,
           "kernel_ms": sum(ms.values()), **{f"{k}_ms": v for k, v in ms.items()},
           **{f"{k}_kernels": n // repeats for k, n in counts.items()}}
    for part, key in (("greedy", "sampler"), ("sample", "sampled_sampler")):
        if part in samplers:
            out[f"{key}_kernels"] = len(samplers[part]) // repeats
            out[f"{key}_ms"] = sum(e.time_range.elapsed_us()
                                   for e in samplers[part]) / 1e3 / repeats
    return out


def _replayed_kernels(runner, key: tuple[int, str], repeats: int) -> list:
    """The CUDA kernel events of `repeats` replays of the graph `key`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    runner.graphs.replay(*key)  # outside the profile: no first-replay upload in the numbers
    torch.cuda.synchronize(runner.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            runner.graphs.replay(*key)
        torch.cuda.synchronize(runner.device)
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]
