"""Trainer compute bench: the step's trainer work per part, model TFLOP/s, MFU, memory, profile.

    handoff bench train-compute --model /tmp/qwen3-4b --rows 256 --prompt-len 36 \
        --response-lens 256 --variant padded --variant packed --out train-compute.json

One actor and one reference model (FSDP2, world size 1) are built once; every variant sets
the actor's micro-batching (padded rows or packed tokens, micro_batch_size /
micro_batch_tokens, gradient checkpointing, the log-prob head) on the same models and runs
the step's trainer work on the same synthetic rollout batch, `repeats` times after a warm-up:
ref forward (ShardedModel.log_probs, params of the ref on the card only for it), actor
forward + backward (Actor.accumulate, the GRPO loss), optimizer step (Actor.step: clip +
AdamW). With --offload (default) the residency is the colocated step's: the ref's params
and the optimizer state come to the card only for their part, through the pinned arena
(those copies are not timed). Each part is timed between device synchronizations (median of
the repeats), with torch.cuda.max_memory_allocated over it.

Model FLOPs = 6 N T (actor) + 2 N T (ref), T = the batch's real tokens (prompt + response,
no padding), N = handoff.plan.trainer.matmul_params (every parameter of a tied model: the
embedding table is the head's GEMM; less the input embedding when untied). MFU = model
FLOPs / the three parts' seconds / a bf16 (model dtype) matmul's FLOP/s timed in the same
run (n x n x n). A last, profiled repeat gives the time per category (bench/train_profile.py)
and the kernel launches. A variant that runs out of memory is reported as such (with the peak
it reached and the planner's model of what it needed) and the next one runs; put such a
variant last (an interrupted FSDP backward may leave state behind).
"""

from __future__ import annotations

import copy
import gc
import math
import statistics
import time

import torch

from handoff.bench.baselines import matmul_flops_per_s
from handoff.bench.train_profile import (OPTIMIZER_RANGE, mark_recompute, profiler_activities,
                                         summarize)
from handoff.config import Config, set_key
from handoff.errors import HandoffError
from handoff.memory.staging import PinnedArena
from handoff.plan.ledger import Dtypes
from handoff.plan.shapes import load_shape
from handoff.plan.trainer import (activation_bytes_per_token, fixed_activation_bytes,
                                  matmul_params)
from handoff.runplan import RunPlan
from handoff.trainer.actor import Actor, resolve_actor_config
from handoff.trainer.attention import backend_for
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.compiled import set_compiled_layers
from handoff.trainer.grpo import group_advantages
from handoff.trainer.model import ShardedModel, set_activation_checkpointing
from handoff.trainer.packing import micro_batch_rows

VARIANT_KEYS = ("micro_batch_tokens", "micro_batch_size", "logprob_chunk_tokens",
                "gradient_checkpointing", "compile")


def builtin_variants(micro_batch_size: int, gradient_checkpointing: bool) -> dict[str, dict]:
    """padded: the first path (rows of micro_batch_size, full logits); packed: tokens sized
    from the card's memory, chunked head, recompute only if needed; compiled: packed with the
    decoder layers through torch.compile (examples/h200-4b.yaml)."""
    return {"padded": {"micro_batch_tokens": 0, "logprob_chunk_tokens": 0,
                       "micro_batch_size": micro_batch_size,
                       "gradient_checkpointing": gradient_checkpointing, "compile": False},
            "packed": {"micro_batch_tokens": "auto", "logprob_chunk_tokens": 2048,
                       "micro_batch_size": micro_batch_size, "gradient_checkpointing": "auto",
                       "compile": False},
            "compiled": {"micro_batch_tokens": "auto", "logprob_chunk_tokens": 2048,
                         "micro_batch_size": micro_batch_size, "gradient_checkpointing": "auto",
                         "compile": True}}


def parse_variant(spec: str, builtins: dict[str, dict]) -> tuple[str, dict]:
    """'NAME' (a builtin) or 'NAME:key=value,...' on top of NAME's builtin (or packed)."""
    name, _, rest = spec.partition(":")
    settings = dict(builtins.get(name, builtins["packed"]))
    if name not in builtins and not rest:
        raise HandoffError(f"variant {spec!r}: name one of {sorted(builtins)} or add settings, "
                           "e.g. big:micro_batch_tokens=32768,gradient_checkpointing=true")
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in VARIANT_KEYS:
            raise HandoffError(f"variant {spec!r}: {item!r} is not key=value with a key of "
                               f"{', '.join(VARIANT_KEYS)}")
        settings[key] = value
    return name, settings


def response_lengths(spec: str, rows: int, seed: int = 0) -> list[int]:
    """'256' | '64,128,256' (cycled) | 'uniform:LO:HI' | 'longtail:MEDIAN:MAX' (log-normal
    around MEDIAN, clipped at MAX, one row at MAX: the long tail padding pays for)."""
    g = torch.Generator().manual_seed(seed)
    kind, _, args = spec.partition(":")
    try:
        if kind == "uniform":
            lo, hi = (int(x) for x in args.split(":"))
            return torch.randint(lo, hi + 1, (rows,), generator=g).tolist()
        if kind == "longtail":
            median, top = (int(x) for x in args.split(":"))
            sigma = math.log(top / median) / 2.5       # MAX sits ~2.5 sigma above the median
            lens = (median * torch.exp(sigma * torch.randn(rows, generator=g))).clamp(1, top)
            lens[int(torch.randint(0, rows, (1,), generator=g))] = top
            return [int(x) for x in lens.round().tolist()]
        values = [int(x) for x in spec.split(",")]
    except ValueError:
        raise HandoffError(f"--response-lens {spec!r}: write N, N,M,..., uniform:LO:HI or "
                           "longtail:MEDIAN:MAX") from None
    return [values[i % len(values)] for i in range(rows)]


def synthetic_batch(vocab: int, *, rows: int, prompt_len: int, response_lens: list[int],
                    group: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(rows):
        if i % group == 0:
            prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        prompts.append(prompt)
        responses.append(torch.randint(0, vocab, (response_lens[i],), generator=g).tolist())
    rewards = torch.randint(0, 2, (rows,), generator=g).float().tolist()
    batch = RolloutBatch.from_tokens(prompts, responses, rewards, group_size=group, pad_id=0)
    batch.ref_logprobs = torch.zeros(batch.input_ids.shape)
    batch.advantages = group_advantages(batch.rewards, group)
    return batch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Meter:
    """Seconds and peak allocated bytes of one part (CUDA: between synchronizations)."""

    def __init__(self, dev: torch.device):
        self.dev = dev

    def __call__(self, fn):
        cuda = self.dev.type == "cuda"
        _sync(self.dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.dev)
        before = torch.cuda.memory_allocated(self.dev) if cuda else 0
        t0 = time.perf_counter()
        out = fn()
        _sync(self.dev)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(self.dev) if cuda else 0
        return out, {"seconds": seconds, "peak_bytes": peak, "extra_bytes": peak - before}


def _apply(actor: Actor, ref: ShardedModel, cfg) -> None:
    actor.cfg = cfg
    for m in (actor, ref):
        m.micro_batch_size = cfg.micro_batch_size
        m.micro_batch_tokens = cfg.micro_batch_tokens
        m.logprob_chunk_tokens = cfg.logprob_chunk_tokens
        set_compiled_layers(m.module, cfg.compile)
    set_activation_checkpointing(actor.module, cfg.gradient_checkpointing)


def _one_round(actor: Actor, ref: ShardedModel, batch: RolloutBatch, meter: _Meter,
               offload: bool) -> dict:
    if offload:
        ref.to("device", params=True).wait()
    _, ref_part = meter(lambda: ref.log_probs(batch, with_entropy=False))
    if offload:
        ref.to("host", params=True).wait()
        actor.to("device", optimizer=True).wait()
    _, fb_part = meter(lambda: actor.accumulate(batch))

    def step():
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            return actor.step()

    _, opt_part = meter(step)
    if offload:
        actor.to("host", optimizer=True).wait()
    return {"ref_forward": ref_part, "actor_forward_backward": fb_part, "optimizer_step": opt_part}


def _restore(actor: Actor, ref: ShardedModel, offload: bool) -> None:
    """After an out-of-memory error: grads dropped, offloaded parts back on the host."""
    actor.optimizer.zero_grad()
    gc.collect()
    if offload:
        ref.to("host", params=True).wait()
        actor.to("host", optimizer=True).wait()
    if actor.device.type == "cuda":
        torch.cuda.empty_cache()


def _run_variant(actor, ref, batch, cfg: Config, lengths, *, repeats, offload, profile) -> dict:
    resolved, choice = resolve_actor_config(RunPlan.build(cfg), actor.device)
    _apply(actor, ref, resolved)
    groups = micro_batch_rows(lengths, micro_batch_tokens=resolved.micro_batch_tokens,
                              micro_batch_size=resolved.micro_batch_size)
    computed = [sum(lengths[r] for r in g) if resolved.micro_batch_tokens else
                len(g) * max(lengths[r] for r in g) for g in groups]
    shape = load_shape(cfg.model.path)
    dtypes = Dtypes.for_model(cfg.model.dtype)
    chunk = resolved.logprob_chunk_tokens
    predicted = (activation_bytes_per_token(shape, checkpointing=resolved.gradient_checkpointing,
                                            chunked_head=chunk > 0, act_bytes=dtypes.param_bytes)
                 * max(computed) + fixed_activation_bytes(shape, logprob_chunk_tokens=chunk,
                                                          act_bytes=dtypes.param_bytes))
    out = {"settings": {k: getattr(resolved, k) for k in VARIANT_KEYS},
           "auto": choice.to_dict() if choice else None, "micro_batches": len(groups),
           "computed_tokens": sum(computed), "largest_micro_batch_tokens": max(computed),
           "predicted_activation_bytes": predicted,
           "attention": backend_for(actor.device, actor.dtype) if resolved.micro_batch_tokens
           else "sdpa"}
    meter = _Meter(actor.device)
    rounds = []
    try:
        _one_round(actor, ref, batch, meter, offload)                # warm-up
        for _ in range(repeats):
            rounds.append(_one_round(actor, ref, batch, meter, offload))
        if profile:
            with torch.profiler.profile(activities=profiler_activities(actor.device)) as prof:
                with mark_recompute(actor.module):
                    _one_round(actor, ref, batch, meter, offload)
            out["profile"] = summarize(prof, actor.device)
    except torch.cuda.OutOfMemoryError as e:
        out["oom"] = True
        out["error"] = str(e).splitlines()[0]
        out["oom_peak_bytes"] = torch.cuda.max_memory_allocated(actor.device)
    if out.get("oom"):
        _restore(actor, ref, offload)       # out of the except: its frames are released
        return out
    parts = {p: {"seconds": statistics.median(r[p]["seconds"] for r in rounds),
                 "seconds_all": [r[p]["seconds"] for r in rounds],
                 "peak_bytes": max(r[p]["peak_bytes"] for r in rounds),
                 "extra_bytes": max(r[p]["extra_bytes"] for r in rounds)} for p in rounds[0]}
    out.update(oom=False, parts=parts,
               compute_seconds=sum(p["seconds"] for p in parts.values()),
               measured_activation_bytes=parts["actor_forward_backward"]["extra_bytes"])
    return out


def run_train_compute_bench(model: str, *, device: str = "cuda", dtype: str = "bfloat16",
                            rows: int = 256, prompt_len: int = 36, response_lens: str = "256",
                            group: int = 8, variants: list[str] | None = None,
                            micro_batch_size: int = 16, gradient_checkpointing: bool = True,
                            repeats: int = 2, offload: bool = True, profile: bool = True,
                            matmul_size: int | None = None, hardware: str | None = None,
                            seed: int = 0, on_variant=None) -> dict:
    """Run every variant on one synthetic batch; returns a JSON-ready dict. `on_variant(result
    so far)` is called after each variant (a long run shows and keeps what it has)."""
    if rows % group:
        raise HandoffError(f"--rows {rows} is not a multiple of --group {group}")
    cfg = Config()
    cfg.model.path, cfg.model.dtype = model, dtype
    cfg.actor.kl_coef = 0.001                       # > 0: the KL term and a reference model
    lens = response_lengths(response_lens, rows, seed)
    cfg.rollout.max_model_len = prompt_len + max(lens)
    arena = PinnedArena(pin=device == "cuda")
    base = builtin_variants(micro_batch_size, gradient_checkpointing)
    specs = [parse_variant(v, base) for v in (variants or ["padded", "packed"])]
    cfg.hardware.name = hardware or ("h200" if device == "cuda" else "cpu")
    first = dict(base["padded"])
    actor = Actor(model, actor=cfg.actor.__class__(**{**vars(cfg.actor), **first}),
                  device=device, dtype=dtype, arena=arena)
    ref = ShardedModel(model, role="ref", device=device, dtype=dtype, arena=arena)
    dev = actor.device
    if offload:
        ref.to("host", params=True).wait()
        actor.to("host", optimizer=True).wait()
    batch = synthetic_batch(actor.module.config.vocab_size, rows=rows, prompt_len=prompt_len,
                            response_lens=lens, group=group, seed=seed).to(dev)
    lengths = [int(x) for x in batch.attention_mask.sum(1).tolist()]
    tokens = sum(lengths)
    shape = load_shape(model)
    n_mm = matmul_params(shape)
    flops = 8 * n_mm * tokens
    n = matmul_size or (8192 if dev.type == "cuda" else 256)
    peak = matmul_flops_per_s(dev, actor.dtype, n)
    results = []
    result = {
        "model": model, "dtype": dtype, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "num_params": shape.num_params, "matmul_params": n_mm, "hardware_profile": cfg.hardware.name,
        "batch": {"rows": rows, "group": group, "prompt_len": prompt_len,
                  "response_lens": response_lens, "tokens": tokens, "longest": max(lengths),
                  "padded_tokens": rows * max(lengths)},
        "flops_formula": "6 N T (actor forward + backward) + 2 N T (ref forward), N = "
                         "matmul params, T = real tokens",
        "model_flops": flops, "offload": offload, "repeats": repeats,
        "matmul": {"n": n, "dtype": str(actor.dtype), "flops_per_s": peak},
        "variants": results}

    for name, settings in specs:
        vcfg = Config()
        vcfg.model, vcfg.hardware, vcfg.rollout = cfg.model, cfg.hardware, cfg.rollout
        vcfg.actor = copy.deepcopy(cfg.actor)   # nested sections (actor.lora) included
        for key, value in settings.items():
            set_key(vcfg, f"actor.{key}", str(value))
        r = {"name": name, **_run_variant(actor, ref, batch, vcfg, lengths, repeats=repeats,
                                          offload=offload, profile=profile)}
        if not r["oom"]:
            s = r["compute_seconds"]
            r.update(tokens_per_s=tokens / s, model_tflops=flops / s / 1e12,
                     mfu=flops / s / peak,
                     measured_bytes_per_token=r["measured_activation_bytes"]
                     / r["largest_micro_batch_tokens"])
        results.append(r)
        if on_variant is not None:
            on_variant(result, r)
    return result


def describe(st: dict) -> str:
    """'packed 8448, head chunk 2048' / 'rows 16, recompute, full logits'."""
    parts = [f"packed {st['micro_batch_tokens']}" if st["micro_batch_tokens"]
             else f"rows {st['micro_batch_size']}"]
    if st["gradient_checkpointing"]:
        parts.append("recompute")
    chunk = st["logprob_chunk_tokens"]
    parts.append(f"head chunk {chunk}" if chunk else "full logits")
    if st.get("compile"):
        parts.append("compiled layers")
    return ", ".join(parts)


def render(result: dict, console) -> None:
    from rich.table import Table

    gb, b = 1e9, result["batch"]
    title = (f"trainer compute, {result['num_params'] / 1e9:.2f}B {result['dtype']}, "
             f"{result['device_name']}: {b['rows']} rows, {b['tokens']} tokens "
             f"(longest {b['longest']}); matmul {result['matmul']['flops_per_s'] / 1e12:.3g} "
             "TFLOP/s")
    table = Table(title=title)
    table.add_column("")
    for v in result["variants"]:
        table.add_column(v["name"], justify="right")

    def cell(v: dict, key: str) -> str:
        if key == "settings":
            return describe(v["settings"])
        if key in ("micro_batches", "computed_tokens", "attention"):
            return str(v[key])
        if key == "model_gb":
            return f"{v['predicted_activation_bytes'] / gb:.2f}"
        if v["oom"]:
            return (f"[red]OOM[/] at {v['oom_peak_bytes'] / gb:.1f} GB" if key == "act_gb"
                    else "")
        p = v["parts"]
        return {"ref": f"{p['ref_forward']['seconds']:.3f}",
                "fb": f"{p['actor_forward_backward']['seconds']:.3f}",
                "opt": f"{p['optimizer_step']['seconds']:.3f}",
                "total": f"{v['compute_seconds']:.3f}",
                "tok_s": f"{v['tokens_per_s']:.0f}", "tflops": f"{v['model_tflops']:.3g}",
                "mfu": f"{v['mfu']:.1%}",
                "act_gb": f"{v['measured_activation_bytes'] / gb:.2f}",
                "peak_gb": f"{max(x['peak_bytes'] for x in p.values()) / gb:.2f}"}[key]

    rows = (("settings", "settings"), ("micro-batches", "micro_batches"),
            ("tokens run (with padding)", "computed_tokens"), ("ref forward s", "ref"),
            ("actor forward + backward s", "fb"), ("optimizer step s", "opt"),
            ("compute s", "total"), ("tokens/s", "tok_s"), ("model TFLOP/s", "tflops"),
            ("MFU", "mfu"), ("activation peak GB (fwd+bwd)", "act_gb"),
            ("  planner's model of it GB", "model_gb"), ("peak allocated GB", "peak_gb"),
            ("packed attention", "attention"))
    for label, key in rows:
        table.add_row(label, *(cell(v, key) for v in result["variants"]))
    console.print(table)
    profiled = [v for v in result["variants"] if v.get("profile")]
    if profiled:
        prof = Table(title="where the time goes (profiled round; share of "
                           f"{profiled[0]['profile']['unit']})")
        prof.add_column("category")
        for v in profiled:
            prof.add_column(v["name"], justify="right")
        cats = list(profiled[0]["profile"]["categories"])
        for c in cats + ["recompute (within the above)", "launches"]:
            cells = []
            for v in profiled:
                pr = v["profile"]
                if c == "launches":
                    cells.append(str(pr["launches"]))
                    continue
                s = pr["recompute_seconds"] if c.startswith("recompute") else pr["categories"][c]
                cells.append(f"{s:.3f} s ({s / max(pr['total_seconds'], 1e-12):.0%})")
            prof.add_row("host_copies (offloads, beside compute)" if c == "host_copies" else c,
                         *cells)
        console.print(prof)
        for v in profiled:
            for c in ("copies", "elementwise_norm", "other"):
                named = v["profile"]["top_kernels"][c]
                if named:
                    console.print(f"{v['name']}, {c}: " + "; ".join(
                        f"{s:.3f} s {n[:70]}" for n, s in named), highlight=False)
    ok = [v for v in result["variants"] if not v["oom"]]
    if len(ok) > 1:
        base = ok[0]
        console.print("; ".join(f"{v['name']}: {base['compute_seconds'] / v['compute_seconds']:.2f}x "
                                f"the speed of {base['name']}" for v in ok[1:]))
    console.print(f"model FLOPs {result['model_flops']:.3g} = {result['flops_formula']}",
                  highlight=False)
