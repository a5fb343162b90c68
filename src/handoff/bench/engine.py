"""`handoff bench engine`: the built-in engine's decode speed against transformers and the HBM floor.

    handoff bench engine --out engine.json                    # full run (CUDA; ~5 min on an H200)
    handoff bench engine --models qwen3-1.7b --batches 1,32 --skip-hf --no-public
    handoff bench engine --lora-rank 16 --skip-hf --no-public   # with an adapter vs without
    handoff bench engine --no-graph-sampling                  # the LM head and sampler eager

Per model shape (random init, bf16, written with handoff.modelzoo.init_model): B prompts of P
random tokens, N new tokens each, greedy, EOS ignored. Reported per batch size B:
* the engine's decode step: wall time of its decode steps / their count (prefill excluded),
  and the host's share of it (the step minus the time spent waiting for the device);
* transformers `generate` on the same checkpoint and batch, in the same run, per decode step:
  (time for 1 + n new tokens - time for 1 new token) / n, with n = --hf-new-tokens (it takes
  ~80-130 ms a step, so it is timed over fewer tokens than the engine); when the longer run
  took no longer (a tiny model, timing noise) it is "not measurable", never a number;
* the roofline of the same step (`roofline_ms`): the weights' part is the longer of their bytes
  at the copy rate and the products' FLOPs at the matmul rate of the same run;
* the HBM floor of a decode step: bytes it must read (every weight once, the embedding only
  as the LM head, plus the K/V of every token in context, averaged over the steps) / the
  device-to-device copy rate measured in this run (bytes read + written);
* what one replay of the decode graph runs: kernel count and device ms (matrix products,
  attention, the rest; then the LM head and the sampler's graph), so a gap to the floor can
  be told apart: launch-bound or not. The replay is the last step, at the longest contexts:
  its kernels are set against that step's own floor (`kernel_over_floor`) and its attention
  against the K/V it reads (`attention_bytes_per_s`), not the mean step's;
* the prefill of the B prompts: its model FLOPs (prefill_flops) / its wall time, against a
  bf16 8192^3 matmul measured in the same run (the compute floor's rate);
* a sampled draw (temperature 1) of the batch's rows by the torch path and by the one-kernel
  draw, device ms each (`draw_ms`: the A/B behind the engine's use of the kernel);
* the BLAS library each ladder size's decode graphs were captured with, with --decode-gemm
  auto the device time of one step under cuBLAS and under cuBLASLt (the faster kept).
With --lora-rank R, each model's decode steps run again on an engine holding a rank-R adapter
on all seven projections (random small values; built with lora_max_rank=R, so the decode
graphs capture its GEMMs), in the same run, and each row sets its step time beside the base's
with the ratio (the goal: within 10%).
Then the workload public engines publish: a Qwen3-0.6B shape, 256 sequences with prompt and
output lengths uniform in [100, 1024], EOS ignored, temperature 0.6: output tokens / wall time
of one generate call after a warm-up call, against its own HBM floor (the engine's
decode_read_bytes: every decode step reads the weights, every sequence's step its whole
context's K/V; at the copy rate; the prefill not counted).
"""

from __future__ import annotations

import datetime
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from handoff.bench.baselines import (copy_bandwidth, draw_ms, free, graph_kernel_profile,
                                     matmul_flops_per_s, transformers_ms_per_step)
from handoff.config.sections import DECODE_GEMMS
from handoff.errors import HandoffError

PUBLIC_A800_TOKENS_PER_S = 10_000  # a comparable engine's published figure (A800)
H200_OVER_A800_BANDWIDTH = 2.4


def floor_ms(weight_bytes: int, kv_bytes_per_token: int, batch: int, prompt_len: int,
             new_tokens: int, bytes_per_s: float) -> float:
    """HBM floor of the mean decode step (decode step j reads prompt_len + j tokens of K/V)."""
    mean_context = prompt_len + new_tokens / 2
    return 1e3 * (weight_bytes + batch * mean_context * kv_bytes_per_token) / bytes_per_s


def roofline_ms(weight_bytes: int, weight_itemsize: int, kv_bytes_per_token: int, batch: int,
                prompt_len: int, new_tokens: int, bytes_per_s: float,
                flops_per_s: float) -> float:
    """floor_ms with the matrix products' compute counted: they take the longer of reading
    the weights and their 2 x params x batch FLOPs at the matmul rate (from ~128 rows on
    an H200, a 4B model's products are compute-bound: the HBM floor alone is unreachable)."""
    weights_s = max(weight_bytes / bytes_per_s,
                    2 * (weight_bytes / weight_itemsize) * batch / flops_per_s)
    kv_ms = floor_ms(0, kv_bytes_per_token, batch, prompt_len, new_tokens, bytes_per_s)
    return 1e3 * weights_s + kv_ms


def prefill_flops(model, num_seqs: int, prompt_len: int) -> float:
    """Model FLOPs of prefilling `num_seqs` fresh prompts of `prompt_len` tokens: 2 x the
    decoder layers' weights per token, the causal attention's two products (4 x heads x
    head_dim per query and each key up to it) per layer, and the LM head for each prompt's
    last token (the only one sampled)."""
    spec = model.spec
    layer_params = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    pairs = num_seqs * prompt_len * (prompt_len + 1) / 2
    attention = 4 * spec.num_heads * spec.head_dim * pairs * spec.num_layers
    head = 2 * spec.vocab_size * spec.hidden_size * num_seqs
    return 2 * layer_params * num_seqs * prompt_len + attention + head


def profiled_step_floor(kernels: dict, context_lens, weight_bytes: int, kv_bytes_per_token: int,
                        bytes_per_s: float) -> dict:
    """The profiled replay is the LAST staged step, whose contexts are the run's longest
    (prompt + new tokens), not the mean the step's floor uses: its own floor (weights + the
    K/V of its staged context lengths, at the copy rate) and its attention's read rate."""
    context = sum(int(n) for n in context_lens)
    kv_bytes = context * kv_bytes_per_token
    floor = 1e3 * (weight_bytes + kv_bytes) / bytes_per_s
    return {"profiled_context_mean": context / len(context_lens),
            "profiled_floor_ms": floor, "kernel_over_floor": kernels["kernel_ms"] / floor,
            "attention_bytes_per_s": (kv_bytes / (kernels["attention_ms"] * 1e-3)
                                      if kernels.get("attention_ms") else None)}


def _engine(path: Path, *, max_num_seqs: int, max_model_len: int, device: torch.device,
            dtype: torch.dtype, util: float, lora_max_rank: int | None = None,
            options: dict | None = None):
    """The bench's engine; `options`: rollout.* settings under test (graph_sampling,
    decode_gemm)."""
    from handoff.config import RolloutConfig
    from handoff.rollout.engine import Engine

    cfg = RolloutConfig(gpu_memory_utilization=util, block_size=16, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, cuda_graphs=True, **(options or {}))
    return Engine(str(path), cfg, device=device, dtype=dtype, lora_max_rank=lora_max_rank)


def random_adapter(path: Path, rank: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A PEFT-named rank-`rank` adapter on every decoder projection of the checkpoint at
    `path`, small random A and B (shapes from its safetensors headers)."""
    from safetensors import safe_open

    from handoff.config.sections import LORA_TARGETS
    from handoff.model_files import weight_files

    gen = torch.Generator().manual_seed(seed)
    adapter = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                module = name.removesuffix(".weight")
                if not (name.startswith("model.layers.") and module.split(".")[-1]
                        in LORA_TARGETS):
                    continue
                out_features, in_features = f.get_slice(name).get_shape()
                adapter[f"{module}.lora_A.weight"] = torch.randn(
                    rank, in_features, generator=gen) / in_features ** 0.5
                adapter[f"{module}.lora_B.weight"] = 0.01 * torch.randn(
                    out_features, rank, generator=gen)
    return adapter


def _timed_generate(engine, prompts, params) -> dict:
    before = engine.stats()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    seconds = after["decode_seconds"] - before["decode_seconds"]
    read = after["decode_read_bytes"] - before["decode_read_bytes"]
    wait = after["decode_wait_seconds"] - before["decode_wait_seconds"]
    return {"outputs": outs, "wall_s": wall, "decode_steps": steps,
            "prefill_steps": after["prefill_steps"] - before["prefill_steps"],
            "prefill_s": after["prefill_seconds"] - before["prefill_seconds"],
            "ms_per_step": 1e3 * seconds / max(steps, 1), "decode_read_bytes": read,
            "host_ms_per_step": 1e3 * (seconds - wait) / max(steps, 1)}


def _engine_facts(engine) -> dict:
    s = engine.stats()
    keys = ("attention_backend", "num_blocks", "kv_cache_bytes", "graph_captures",
            "graph_pool_bytes", "graph_driver_bytes", "graph_reserve_bytes", "packed_prefill",
            "activation_peak_bytes", "preemptions", "prefix_cache_hits", "decode_gemm",
            "decode_gemm_ms", "skinny_tune_s")
    return {k: s[k] for k in keys}


def engine_decode(path: Path, batches: list[int], *, prompt_len: int, new_tokens: int,
                  device: torch.device, dtype: torch.dtype, util: float, bytes_per_s: float,
                  flops_per_s: float, seed: int = 0, lora_rank: int = 0,
                  options: dict | None = None) -> dict:
    """The engine's decode step at each batch size, with its HBM floor, and the prefill of
    its prompts against the matmul rate `flops_per_s` (lora_rank > 0: with a random adapter
    of that rank loaded)."""
    from handoff.rollout.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    engine = _engine(path, max_num_seqs=max(batches), max_model_len=prompt_len + new_tokens + 1,
                     device=device, dtype=dtype, util=util, lora_max_rank=lora_rank or None,
                     options=options)
    build_s = time.perf_counter() - start
    adapter = {name: t.to(device, dtype) for name, t in
               random_adapter(path, lora_rank, seed=seed).items()} if lora_rank else {}
    if adapter:
        engine.load_adapter(adapter, alpha=2.0 * lora_rank, rank=lora_rank)
    vocab = engine.spec.vocab_size
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.generate(rng.integers(0, vocab, (min(4, max(batches)), prompt_len)).tolist(), warm)
    weights = engine.decode_weight_bytes
    kv_token = engine.runner.kv_block_bytes() // engine.blocks.block_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = rng.integers(0, vocab, (batch, prompt_len)).tolist()
        run = _timed_generate(engine, prompts, params)
        lengths = {len(s.token_ids) for o in run.pop("outputs") for s in o.outputs}
        assert lengths == {new_tokens}, lengths
        floor = floor_ms(weights, kv_token, batch, prompt_len, new_tokens, bytes_per_s)
        roof = roofline_ms(weights, engine.dtype.itemsize, kv_token, batch, prompt_len,
                           new_tokens, bytes_per_s, flops_per_s)
        prefill_rate = prefill_flops(engine.model, batch, prompt_len) / run["prefill_s"]
        kernels = graph_kernel_profile(engine.runner, batch)
        draws = (draw_ms(batch, engine.spec.vocab_size, device, dtype)
                 if device.type == "cuda" else {})
        if "kernel_ms" in kernels:
            kernels.update(profiled_step_floor(kernels, engine.runner.inputs.h["ctx"][:batch],
                                               weights, kv_token, bytes_per_s))
        engine.reset_prefix_cache()  # the profile rewrote the last step's slots
        rows.append({"batch": batch, **run, "tokens_per_s": batch * 1e3 / run["ms_per_step"],
                     "floor_ms": floor, "over_floor": run["ms_per_step"] / floor,
                     "roofline_ms": roof, "over_roofline": run["ms_per_step"] / roof,
                     "prefill_flops_per_s": prefill_rate,
                     "prefill_of_peak": prefill_rate / flops_per_s,
                     "graph_kernels": kernels, "draw_ms": draws})
    result = {"build_s": build_s, "weight_bytes": weights, "kv_bytes_per_token": kv_token,
              "lora_rank": lora_rank, "adapter_tensors": len(adapter), **_engine_facts(engine),
              "rows": rows}
    engine.sleep(2)  # region memory lives as long as the process unless released
    del engine
    free(device)
    return result


def public_workload(path: Path, *, num_seqs: int, lengths: tuple[int, int],
                    device: torch.device, dtype: torch.dtype, util: float, bytes_per_s: float,
                    seed: int = 0, options: dict | None = None) -> dict:
    """num_seqs sequences, prompt and output lengths uniform in `lengths`, EOS ignored."""
    from handoff.rollout.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    lo, hi = lengths
    engine = _engine(path, max_num_seqs=num_seqs, max_model_len=2 * hi, device=device,
                     dtype=dtype, util=util, options=options)
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
    prompt_lens = rng.integers(lo, hi + 1, num_seqs)
    output_lens = rng.integers(lo, hi + 1, num_seqs)
    prompts = [rng.integers(0, min(10_000, engine.spec.vocab_size), n).tolist()
               for n in prompt_lens]
    params = [SamplingParams(temperature=0.6, max_tokens=int(n), ignore_eos=True)
              for n in output_lens]
    # The prefills once before the timed run, apart (one token each; the prefix cache then
    # forgotten): what a first prefill of these shapes costs over the next (kernel builds,
    # allocator growth) is `first_prefill_s` less `prefill_s`, not in the throughput.
    first = _timed_generate(engine, prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.reset_prefix_cache()
    run = _timed_generate(engine, prompts, params)
    produced = sum(len(s.token_ids) for o in run.pop("outputs") for s in o.outputs)
    assert produced == int(output_lens.sum()), (produced, int(output_lens.sum()))
    floor = run["decode_read_bytes"] / bytes_per_s
    decode_s = run["ms_per_step"] * run["decode_steps"] / 1e3
    result = {"num_seqs": num_seqs, "lengths": [lo, hi], "temperature": 0.6,
              "prompt_tokens": int(prompt_lens.sum()), "output_tokens": produced, **run,
              "first_prefill_s": first["prefill_s"],
              "tokens_per_s": produced / run["wall_s"], "decode_floor_s": floor,
              "decode_over_floor": decode_s / floor if floor else None, **_engine_facts(engine)}
    engine.sleep(2)
    del engine
    free(device)
    return result


def _checkpoint(preset: str, workdir: Path, device: torch.device, dtype: str) -> Path:
    from handoff.modelzoo import init_model

    # The bench's own scratch directory: a preset benched twice is written again.
    path = init_model(preset, workdir / preset, dtype=dtype, device=str(device), overwrite=True)
    free(device)
    return path


def run_engine_bench(*, models: list[str], batches: list[int], prompt_len: int = 256,
                     new_tokens: int = 512, hf_new_tokens: int = 32, skip_hf: bool = False,
                     public: bool = True, public_model: str = "qwen3-0.6b",
                     public_seqs: int = 256, public_lengths: tuple[int, int] = (100, 1024),
                     util: float = 0.5, device: str = "cuda", dtype: str = "bfloat16",
                     workdir: str | None = None, lora_rank: int = 0,
                     graph_sampling: bool = True, decode_gemm: str = "cublas",
                     on_part: Callable[[str, dict], None] | None = None) -> dict:
    """Run every model x batch (engine, transformers; with lora_rank, the engine again with an
    adapter) and the public workload; a JSON dict. `on_part(name, result so far)` after each
    model and the public workload (a long bench cut short keeps what it measured)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HandoffError("bench engine measures the engine on a GPU but no CUDA device is "
                           "visible: run it on the GPU machine (or pass --device cpu for a smoke run)")
    if not batches or min(batches) < 1 or prompt_len < 1 or new_tokens < 2 or \
            hf_new_tokens < 1 or len(public_lengths) != 2 or not 1 <= public_lengths[0] <= \
            public_lengths[1] or lora_rank < 0:
        raise HandoffError("bench engine needs batches >= 1, --prompt-len >= 1, --new-tokens "
                           ">= 2, --hf-new-tokens >= 1, --public-lengths MIN,MAX with "
                           "1 <= MIN <= MAX and --lora-rank >= 0: fix the options")
    if decode_gemm not in DECODE_GEMMS:
        raise HandoffError(f"bench engine --decode-gemm {decode_gemm!r}: pass one of "
                           f"{', '.join(DECODE_GEMMS)}")
    torch_dtype = getattr(torch, dtype)
    own_dir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="handoff-bench-engine-")) if own_dir else Path(workdir)
    props = torch.cuda.get_device_properties(dev) if dev.type == "cuda" else None
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": props.name if props else "cpu", "torch": torch.__version__,
              "dtype": dtype, "prompt_len": prompt_len, "new_tokens": new_tokens,
              "hf_new_tokens": hf_new_tokens, "lora_rank": lora_rank,
              "graph_sampling": graph_sampling, "decode_gemm": decode_gemm,
              "copy_bytes_per_s": copy_bandwidth(dev),
              "matmul_flops_per_s": matmul_flops_per_s(
                  dev, torch_dtype, 8192 if dev.type == "cuda" else 256), "models": {}}
    options = {"graph_sampling": graph_sampling, "decode_gemm": decode_gemm}
    try:
        for preset in models:
            path = _checkpoint(preset, root, dev, dtype)
            hf = {} if skip_hf else transformers_ms_per_step(
                path, batches, prompt_len=prompt_len, new_tokens=hf_new_tokens, device=dev,
                dtype=torch_dtype)
            entry = engine_decode(path, batches, prompt_len=prompt_len, new_tokens=new_tokens,
                                  device=dev, dtype=torch_dtype, util=util,
                                  bytes_per_s=result["copy_bytes_per_s"],
                                  flops_per_s=result["matmul_flops_per_s"],
                                  options=options)
            for row in entry["rows"]:
                base = hf.get(row["batch"]) or {}
                hf_ms = base.get("ms_per_step")   # None: skipped, or not measurable
                row["hf_ms_per_step"] = hf_ms
                row["speedup_vs_hf"] = hf_ms / row["ms_per_step"] if hf_ms else None
                if base.get("not_measurable"):
                    row["hf_not_measurable"] = base["not_measurable"]
            entry["transformers"] = hf
            if lora_rank:
                entry["lora"] = _with_adapter(entry, engine_decode(
                    path, batches, prompt_len=prompt_len, new_tokens=new_tokens, device=dev,
                    dtype=torch_dtype, util=util, bytes_per_s=result["copy_bytes_per_s"],
                    flops_per_s=result["matmul_flops_per_s"], lora_rank=lora_rank,
                    options=options))
            result["models"][preset] = entry
            if on_part:
                on_part(preset, result)
        if public:
            path = _checkpoint(public_model, root, dev, dtype)
            result["public"] = {"model": public_model, **public_workload(
                path, num_seqs=public_seqs, lengths=public_lengths, device=dev,
                dtype=torch_dtype, util=util, bytes_per_s=result["copy_bytes_per_s"],
                options=options)}
            result["public"]["h200_scaled_reference_tokens_per_s"] = \
                PUBLIC_A800_TOKENS_PER_S * H200_OVER_A800_BANDWIDTH
            if on_part:
                on_part("public workload", result)
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    return result


def _with_adapter(entry: dict, lora: dict) -> dict:
    """Each base row gets the adapter's step time at its batch and the ratio; returns `lora`."""
    for row, lora_row in zip(entry["rows"], lora["rows"]):
        assert row["batch"] == lora_row["batch"], (row["batch"], lora_row["batch"])
        row["lora_ms_per_step"] = lora_row["ms_per_step"]
        row["lora_over_base"] = lora_row["ms_per_step"] / row["ms_per_step"]
    return lora


def _timed_backends(ms: dict | None) -> str:
    if not ms:
        return "named"
    return ", ".join(f"{backend} {t:.3f}" for backend, t in ms.items())


def _hf_cells(row: dict) -> tuple[str, str]:
    """The HF ms/step and x HF cells: "-" when transformers was skipped, "n/a" when its step
    was not measurable (a line below the table says why), never a made-up number."""
    hf = row["hf_ms_per_step"]
    if row.get("hf_not_measurable"):
        return "n/a", "n/a"
    if hf is None:
        return "-", "-"
    return (f"{hf:.1f}" if hf >= 1 else f"{hf:.3f}"), f"{row['speedup_vs_hf']:.1f}"


def render(result: dict, console) -> None:
    """Print one table of decode steps and a line for the public workload."""
    from rich.table import Table

    table = Table(title=f"engine decode, {result['device']}, {result['dtype']}, "
                        f"{result['prompt_len']}-token prompts, {result['new_tokens']} new "
                        f"tokens, sampler {'in' if result['graph_sampling'] else 'outside'} "
                        "the graphs "
                        f"(transformers timed over {result['hf_new_tokens']}); copy floor "
                        f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul "
                        f"{result['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    lora = result.get("lora_rank", 0)
    lora_cols = (f"LoRA r{lora} ms/step", "x base") if lora else ()
    for col in ("model", "batch", "engine ms/step", *lora_cols, "host ms", "tok/s", "floor ms",
                "x floor", "x roofline", "prefill % peak", "HF ms/step", "x HF", "kernels",
                "kernel ms (gemm/attn/other)",
                "graphs / pool"):
        table.add_column(col, justify="right")
    for preset, entry in result["models"].items():
        for r in entry["rows"]:
            k = r.get("graph_kernels") or {}
            kernels = (f"{k['kernel_ms']:.2f} ({k['gemm_ms']:.2f}/{k['attention_ms']:.2f}/"
                       f"{k['other_ms']:.2f})" if "kernel_ms" in k else k.get("error", "-")[:30])
            if "sampler_ms" in k:
                kernels += f" + head/sampler {k['sampler_ms']:.2f}"
            if "sampled_sampler_ms" in k:
                kernels += f" (sampled: {k['sampled_sampler_ms']:.2f})"
            if "kernel_over_floor" in k:   # the last step, against its own floor
                attn = k["attention_bytes_per_s"]
                kernels += (f"; last step {k['kernel_over_floor']:.2f}x its floor"
                            + (f", attn {attn / 1e12:.2f} TB/s" if attn else ""))
            with_lora = ((f"{r['lora_ms_per_step']:.2f}", f"{r['lora_over_base']:.2f}")
                         if lora else ())
            table.add_row(preset, str(r["batch"]), f"{r['ms_per_step']:.2f}", *with_lora,
                          f"{r['host_ms_per_step']:.2f}", f"{r['tokens_per_s']:.0f}",
                          f"{r['floor_ms']:.2f}", f"{r['over_floor']:.2f}",
                          f"{r['over_roofline']:.2f}",
                          f"{100 * r['prefill_of_peak']:.0f}%",
                          *_hf_cells(r),
                          str(k.get("kernels", "-")), kernels,
                          f"{entry['graph_captures']} / {entry['graph_pool_bytes'] / 2**20:.0f} MiB")
    width = console.width
    console.width = max(width, 200)  # print(width=) can only narrow; logs default to 80 columns
    try:
        console.print(table)
    finally:
        console.width = width
    for preset, entry in result["models"].items():
        for r in entry["rows"]:
            if r.get("hf_not_measurable"):
                console.print(f"{preset} transformers at batch {r['batch']}: not measurable "
                              f"({r['hf_not_measurable']}): raise --hf-new-tokens",
                              highlight=False, markup=False, soft_wrap=True)
        if entry.get("decode_gemm"):
            libs = entry["decode_gemm"]
            console.print(f"{preset} decode GEMMs (device ms of a step under each): " +
                          "; ".join(f"{b}: {libs[b]} "
                                    f"({_timed_backends(entry['decode_gemm_ms'].get(b))})"
                                    for b in sorted(libs, key=int)), highlight=False,
                          soft_wrap=True)
    pub = result.get("public")
    if pub:
        console.print(
            f"public workload ({pub['model']}, {pub['num_seqs']} seqs, lengths U{pub['lengths']}, "
            f"T={pub['temperature']}): {pub['output_tokens']} tokens in {pub['wall_s']:.2f} s = "
            f"[bold]{pub['tokens_per_s']:.0f} tok/s[/] ({pub['decode_steps']} decode steps, "
            f"{pub['ms_per_step']:.2f} ms/step, host {pub['host_ms_per_step']:.2f} ms; "
            + (f"decode {pub['decode_over_floor']:.2f}x its HBM floor of "
               f"{pub['decode_floor_s']:.2f} s, " if pub.get("decode_over_floor") else "")
            + f"prefill {pub['prefill_s']:.2f} s, the first of these shapes "
            f"{pub['first_prefill_s']:.2f} s); "
            f"reference ~{PUBLIC_A800_TOKENS_PER_S} tok/s on an A800 x "
            f"{H200_OVER_A800_BANDWIDTH} bandwidth = {pub['h200_scaled_reference_tokens_per_s']:.0f}",
            highlight=False, soft_wrap=True)
