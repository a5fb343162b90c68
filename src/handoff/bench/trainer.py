"""Trainer offload bench: measured bytes and seconds of each switch part vs the plan's ledger.

    handoff bench trainer --model /tmp/m17 --out bench-trainer.json

Builds the FSDP2 actor (bf16 params, fp32 master + Adam) and the reference model from an HF
checkpoint on one device, runs one GRPO update on a synthetic batch so every part holds real
state, then moves the parts in the switch's order (optimizer D2H, params D2H, ref D2H, params
H2D, optimizer H2D, ref H2D) `repeats` times through the pinned arena. Per action it reports
the bytes moved, the device memory actually released or re-taken (torch.cuda.memory_allocated,
which rounds each block up to 512 B), the copy-stream seconds (CUDA events) and the wall
seconds of the call (the first round also allocates the pinned host buffers), next to the
ledger of `handoff plan` for the same shape on the chosen hardware profile.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from handoff.config import Config
from handoff.errors import HandoffError
from handoff.memory.staging import PinnedArena
from handoff.runplan import RunPlan
from handoff.trainer.actor import build_actor, build_reference
from handoff.trainer.batch import RolloutBatch

ORDER = (("optimizer_d2h", "actor", "host", "optimizer"), ("params_d2h", "actor", "host", "params"),
         ("ref_d2h", "ref", "host", "params"), ("params_h2d", "actor", "device", "params"),
         ("optimizer_h2d", "actor", "device", "optimizer"), ("ref_h2d", "ref", "device", "params"))
GROUP = 4   # samples per prompt in the synthetic GRPO batch: --rows is whole groups of it


def ledger_rows(model: str, dtype: str, hardware: str) -> tuple[dict[str, dict], str]:
    """Planned bytes and seconds per action for one card (all offloads on), and the source.

    Uses the planner's ledger; where that module is absent (an older tree) the same bytes
    come from the source's formula (2N params and ref, 12N optimizer with bf16 params) at the
    measured H200 pinned rate of 55 GB/s, and the source says so.
    """
    from handoff.config import MemoryConfig, ParallelConfig
    from handoff.plan.shapes import load_shape

    shape = load_shape(model)
    try:
        from handoff.plan.hardware import hardware_profile
        from handoff.plan.ledger import Dtypes, switch_actions
    except ImportError:
        width = 4 if dtype == "float32" else 2
        part = {"params": width, "optimizer": 8 if width == 4 else 12, "ref": width}
        rows = {}
        for name, who, _, what in ORDER:
            nbytes = shape.num_params * part["ref" if who == "ref" else what]
            rows[name] = {"bytes": nbytes, "seconds": nbytes / 55e9}
        return rows, "formula N x bytes/param at 55 GB/s (handoff.plan.ledger not found)"
    # The bench copies every part each way: the sequential switch's actions.
    actions = switch_actions(shape, ParallelConfig(gpus=1), MemoryConfig(overlap=False),
                             hardware_profile(hardware), kv_pool_bytes=0,
                             dtypes=Dtypes.for_model(dtype))
    return ({a.name: {"bytes": a.bytes_per_card, "seconds": a.seconds} for a in actions},
            f"handoff.plan.ledger ({hardware})")


def synthetic_batch(vocab: int, *, rows: int, seq_len: int, group: int, seed: int = 0
                    ) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_len = max(1, seq_len // 8)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(0, vocab, (seq_len - prompt_len,), generator=g).tolist()
                 for _ in range(rows)]
    rewards = torch.randint(0, 2, (rows,), generator=g).float().tolist()
    return RolloutBatch.from_tokens(prompts, responses, rewards, group_size=group, pad_id=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _timed(fn, device: torch.device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def run_trainer_bench(model: str, *, device: str = "cuda", dtype: str = "bfloat16",
                      repeats: int = 3, rows: int = 8, seq_len: int = 512, micro_batch: int = 4,
                      hardware: str = "h200", compare_fsdp: bool = False) -> dict:
    """Measure the trainer's part of the switch; returns a JSON-ready dict."""
    if rows % GROUP:   # before a model is built, in the option's own name
        whole = max(GROUP, -(-rows // GROUP) * GROUP)
        raise HandoffError(f"--rows {rows} is not a multiple of {GROUP}, the bench's GRPO "
                           f"group (its batch is whole groups of {GROUP} samples of a prompt): "
                           f"pass --rows {whole}")
    cfg = Config()
    cfg.model.path, cfg.model.dtype = model, dtype
    cfg.actor.kl_coef, cfg.actor.micro_batch_size = 0.001, micro_batch   # kl > 0: a ref model
    arena = PinnedArena()
    plan = RunPlan.build(cfg)
    (actor, ref), init_s = _timed(lambda: (build_actor(cfg, plan, device=device, arena=arena),
                                           build_reference(cfg, plan, device=device,
                                                           arena=arena)),
                                  torch.device("cpu"))
    dev = actor.device
    vocab = actor.module.config.vocab_size
    batch = synthetic_batch(vocab, rows=rows, seq_len=seq_len, group=GROUP).to(dev)
    (batch.old_logprobs, _), logp_s = _timed(lambda: actor.log_probs(batch, with_entropy=False), dev)
    (batch.ref_logprobs, _), ref_s = _timed(lambda: ref.log_probs(batch, with_entropy=False), dev)
    metrics, update_s = _timed(lambda: actor.update(batch), dev)
    owners = {"actor": actor, "ref": ref}
    runs: dict[str, list[dict]] = {name: [] for name, *_ in ORDER}
    for _ in range(repeats):
        for name, who, where, part in ORDER:
            before = _allocated(dev)
            t0 = time.perf_counter()
            done = owners[who].to(where, **{part: True}).wait()[part]
            wall = time.perf_counter() - t0
            runs[name].append({"bytes": done["bytes"], "seconds": done["seconds"], "wall": wall,
                               "allocated_delta": _allocated(dev) - before})
    planned, source = ledger_rows(model, dtype, hardware)
    actions = []
    for name, *_ in ORDER:
        r = runs[name]
        secs = [x["seconds"] for x in r]
        med = statistics.median(secs)
        actions.append({
            "action": name, "bytes": r[-1]["bytes"], "ledger_bytes": planned[name]["bytes"],
            "bytes_match": all(x["bytes"] == planned[name]["bytes"] for x in r),
            "device_bytes_released": abs(r[-1]["allocated_delta"]),
            "seconds": med, "seconds_all": secs, "wall_seconds_all": [x["wall"] for x in r],
            "ledger_seconds": planned[name]["seconds"],
            "gbps": r[-1]["bytes"] / med / 1e9 if med > 0 else 0.0})
    result = {
        "model": model, "dtype": dtype, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "num_params": actor.memory_parts()["params"] // actor.dtype.itemsize,
        "actor_parts": actor.memory_parts(), "ref_parts": ref.memory_parts(),
        "pinned_host_bytes": arena.bytes_staged(), "ledger_source": source,
        "batch": {"rows": rows, "seq_len": seq_len, "micro_batch": micro_batch},
        "seconds": {"init": init_s, "log_probs": logp_s, "ref_log_probs": ref_s,
                    "update": update_s},
        "update_metrics": metrics, "actions": actions}
    if compare_fsdp:
        del actor, ref, owners
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        result["fsdp_offload_mode"] = _fsdp_mode_update(cfg, device, batch)
    return result


def _fsdp_mode_update(cfg: Config, device: str, batch: RolloutBatch) -> dict:
    """The same update with FSDP2's CPUOffloadPolicy: nothing to move, slower steps."""
    cfg.memory.offload_mode = "fsdp"
    actor = build_actor(cfg, RunPlan.build(cfg), device=device)
    dev = actor.device
    _timed(lambda: actor.update(batch), dev)             # first step: warm-up
    _, update_s = _timed(lambda: actor.update(batch), dev)
    return {"update_seconds": update_s,
            "device_allocated_bytes": _allocated(dev)}


def render(result: dict, console) -> None:
    from rich.table import Table

    gb = 1e9
    table = Table(title=f"trainer switch parts, {result['num_params'] / 1e9:.2f}B params "
                        f"{result['dtype']}, {result['device_name']}")
    for col in ("action", "GB", "ledger GB", "same", "freed GB", "s", "ledger s", "GB/s",
                "1st wall s"):
        table.add_column(col, justify="left" if col == "action" else "right",
                         no_wrap=col == "action")
    for a in result["actions"]:
        table.add_row(a["action"], f"{a['bytes'] / gb:.3f}", f"{a['ledger_bytes'] / gb:.3f}",
                      "yes" if a["bytes_match"] else "[red]NO[/]",
                      f"{a['device_bytes_released'] / gb:.3f}", f"{a['seconds']:.3f}",
                      f"{a['ledger_seconds']:.3f}", f"{a['gbps']:.1f}",
                      f"{a['wall_seconds_all'][0]:.2f}")
    console.print(table)
    s = result["seconds"]
    console.print(f"ledger: {result['ledger_source']}; pinned host: "
                  f"{result['pinned_host_bytes'] / gb:.2f} GB; init {s['init']:.1f} s, "
                  f"log_probs {s['log_probs']:.3f} s, ref {s['ref_log_probs']:.3f} s, "
                  f"update {s['update']:.3f} s")
    if "fsdp_offload_mode" in result:
        f = result["fsdp_offload_mode"]
        console.print(f"FSDP2 CPUOffloadPolicy update: {f['update_seconds']:.3f} s "
                      f"(device allocated {f['device_allocated_bytes'] / gb:.2f} GB)")
