"""`handoff plan` end to end: a config in, one JSON-ready report out (no torch, no GPU).

    report = build_plan(load_config(None, ["model.path=qwen3-32b", "parallel.gpus=8"]),
                        auto_tp=True)
    report["switch"]["total_seconds"], report["verdict"]["mode"]

The report's keys are the `--json` contract (bytes in bytes, times in seconds):
model, hardware, layout, workload, memory {train, generate}, switch {actions (each with its
exposed_seconds), total_bytes_per_card, total_seconds, exposed_seconds, share_of_step}, step
{seconds, source, modelled_seconds, generation_seconds, switch_seconds (the exposed ones:
plan.ledger.exposed_seconds), train_seconds, ...}, kv [rows], kv_gain,
pinned_host_bytes_per_node, compile {on, requested, compile_seconds, saving_seconds, warm,
reason} (actor.compile as the run decides it: plan/compile.py), verdict {fits, mode, max_utilization, reasons, fix, advice}
(advice: {overrides, flags, mode} of a plan that fits, or null), offload_sets {sets
[{offloads, fits, utilization, kv_pool_bytes, generation_seconds, switch_seconds,
step_seconds}], recommended} (every offload set at its highest safe utilization; its
switch_seconds exposed).
"""

from __future__ import annotations

import dataclasses

from handoff.config import Config, MemoryConfig
from handoff.errors import HandoffError
from handoff.lengths import ResponseLengths
from handoff.plan.advice import advice_text, find_fitting_plan, offload_options
from handoff.plan.compile import choose_compile, compiled_rate, named_device
from handoff.plan.hardware import HardwareProfile, hardware_profile
from handoff.plan.kvpool import (Workload, engine_weight_bytes, generation_gain, kv_pool_bytes,
                                 kv_table)
from handoff.plan.ledger import (Dtypes, SwitchAction, memory_by_owner, offloaded_bytes_per_card,
                                 shard_size, switch_actions, switch_summary, weight_sync_seconds)
from handoff.plan.shapes import ModelShape, load_shape
from handoff.plan.trainer import exposed_behind_compute, model_flops
from handoff.plan.verdict import (HOST_FRACTION, TRAIN_PEAK_FRACTION, decide, elastic_utilization,
                                  max_safe_utilization, training_peak_bytes)

# Without --tokens-per-step each card generates this many responses of mean length L per step
# (e.g. 512 prompts x 16 samples over 64 cards).
DEFAULT_RESPONSES_PER_CARD = 128
# Without --tp: one engine per card when the weights take at most this share of HBM, else one
# engine per node (verl's colocated recipes for models that do not fit a card comfortably).
AUTO_TP_WEIGHT_SHARE = 0.25


def auto_tp(shape: ModelShape, hw: HardwareProfile, gpus: int, dtypes: Dtypes) -> int:
    """TP 1 for a model whose weights sit comfortably on one card, else a node's cards."""
    if shape.num_params * dtypes.engine_bytes <= AUTO_TP_WEIGHT_SHARE * hw.hbm_bytes:
        return 1
    tp = 1
    while tp * 2 <= min(gpus, hw.gpus_per_node) and gpus % (tp * 2) == 0:
        tp *= 2
    return tp


def trained_tokens_per_card(workload: Workload) -> float:
    """Prompt + response tokens one card trains on per step of `workload`."""
    responses = workload.tokens_per_card / workload.response_len
    return workload.tokens_per_card + responses * workload.prompt_len


def step_time(shape: ModelShape, hw: HardwareProfile, workload: Workload,
              actions: list[SwitchAction], generation_seconds: float | None, *,
              memory: MemoryConfig, elastic_pool: bool, given: float | None, ref: bool,
              updates_per_step: int, lora: bool = False,
              lora_order: bool | None = None) -> tuple[dict, dict]:
    """The step's seconds and each switch action's exposed seconds. The step: the given one,
    else generation + the switch's exposed seconds + the trainer's compute (plan.trainer:
    model FLOPs of the card's prompt + response tokens / train_flops_per_s, the compiled
    rate when actor.compile resolves on: plan.compile.compiled_rate); with
    memory.overlap the copies back hide behind its forwards before the update
    (plan.ledger.exposed_seconds); `lora`: a frozen base's compute, and LoRA's switch order
    unless `lora_order` says otherwise (exposed_behind_compute)."""
    tokens = trained_tokens_per_card(workload)
    train_s, exposed = exposed_behind_compute(
        {a.name: a.seconds for a in actions}, memory, shape, tokens, hw, ref=ref,
        updates_per_step=updates_per_step, generation_seconds=generation_seconds,
        elastic_pool=elastic_pool, lora=lora, lora_order=lora_order)
    switch_s = sum(exposed.values())
    modelled = (generation_seconds + switch_s + train_s
                if generation_seconds is not None else None)
    return {"seconds": given or modelled, "source": "given" if given else "modelled",
            "modelled_seconds": modelled, "generation_seconds": generation_seconds,
            "switch_seconds": switch_s, "train_seconds": train_s,
            "train_tokens_per_card": tokens,
            "train_flops_per_card": model_flops(shape, tokens, ref=ref,
                                                old_logprobs=updates_per_step > 1,
                                                lora=lora),
            "train_flops_per_s": hw.train_flops_per_s}, exposed


def plan_workload(cfg: Config, gpus: int, hw: HardwareProfile) -> tuple[Workload, list[str]]:
    """What one step asks of each card's engine, and the assumptions made where the config
    is silent (the report's workload.assumed)."""
    wl_cfg = cfg.workload
    assumed = []
    if wl_cfg.tokens_per_step:
        tokens_per_card = wl_cfg.tokens_per_step / gpus
    else:
        tokens_per_card = DEFAULT_RESPONSES_PER_CARD * wl_cfg.response_len
        assumed.append(f"{DEFAULT_RESPONSES_PER_CARD} responses of {wl_cfg.response_len} tokens "
                       "per card per step (pass --tokens-per-step)")
    if not wl_cfg.max_response_len:
        assumed.append("no long tail (pass --max-response-len)")
    if not wl_cfg.step_seconds:
        assumed.append(f"training at {hw.train_flops_per_s / 1e12:.0f} model TFLOP/s per card, "
                       "step time modelled (pass --train-tflops or --step-seconds)")
    spec = cfg.rollout.response_lengths
    lengths = (ResponseLengths.parse(spec).quantiles(
        max(int(round(tokens_per_card / wl_cfg.response_len)), 1), cfg.rollout.max_tokens)
        if spec else None)
    if lengths:
        assumed.append(f"responses of rollout.response_lengths={spec}, simulated step by step")
    workload = Workload(prompt_len=wl_cfg.prompt_len, response_len=wl_cfg.response_len,
                        tokens_per_card=tokens_per_card, max_response_len=wl_cfg.max_response_len,
                        max_num_seqs=cfg.rollout.max_num_seqs, lengths=lengths,
                        group_size=cfg.rollout.n)
    return workload, assumed


def build_plan(cfg: Config, *, ref: bool | None = None, grad_offload: bool = False,
               auto_tp_size: bool = False, advise: bool = True,
               compile_warm: bool = False) -> dict:
    """Every table of `handoff plan` as one dict, whether the run fits or not; raises
    HandoffError only on unusable input. A plan that does not fit carries, with `advise`,
    the smallest change that re-plans to one that fits (plan/advice.py). A reference model
    is priced when `ref`, by default when actor.kl_coef > 0 (a run builds one only then).
    `compile_warm`: the persistent compile cache holds this layer shape (the CLI asks
    handoff.compile_cache), so actor.compile=auto is priced at a warm start."""
    ref = cfg.actor.kl_coef > 0 if ref is None else ref
    shape = load_shape(cfg.model.path)
    hw = hardware_profile(cfg.hardware.name, cfg.hardware)
    dtypes = Dtypes.for_model(cfg.model.dtype, cfg.rollout.kv_dtype)
    parallel = dataclasses.replace(cfg.parallel)
    if auto_tp_size:
        parallel.tp = auto_tp(shape, hw, parallel.gpus, dtypes)
    if parallel.tp > parallel.gpus or parallel.gpus % parallel.tp:
        raise HandoffError(f"--tp {parallel.tp} does not divide --gpus {parallel.gpus}: pick a "
                           "divisor of the card count")
    memory, wl_cfg = cfg.memory, cfg.workload
    elastic = cfg.rollout.kv_pool == "elastic"
    util = (round(elastic_utilization(shape, parallel, memory, hw, dtypes=dtypes, ref=ref), 4)
            if elastic else cfg.rollout.gpu_memory_utilization)
    workload, assumed = plan_workload(cfg, parallel.gpus, hw)

    weights = engine_weight_bytes(shape, parallel.tp, dtypes.engine_bytes)
    pool = kv_pool_bytes(util, hw, weights)   # negative: a reason of the verdict
    bucket = cfg.sync.bucket_mb * 2 ** 20
    actions = switch_actions(shape, parallel, memory, hw, kv_pool_bytes=pool, dtypes=dtypes,
                             ref=ref, grad_offload=grad_offload, bucket_bytes=bucket,
                             elastic_pool=elastic, updates_per_step=cfg.actor.updates_per_step)
    cards_per_node = min(parallel.gpus, hw.gpus_per_node)
    pinned_per_card = offloaded_bytes_per_card(actions)
    pinned_per_node = cards_per_node * pinned_per_card
    sync_seconds = weight_sync_seconds(shape, parallel, hw, dtypes, bucket)

    best = max_safe_utilization(shape, parallel, memory, hw, dtypes=dtypes, ref=ref)
    rows = kv_table(shape, hw, tp=parallel.tp, workload=workload, requested=util,
                    best=best if best > 0 else None, weight_bytes=dtypes.engine_bytes,
                    kv_bytes=dtypes.kv_bytes)
    req_row = next(r for r in rows if r.requested)
    compiled = choose_compile(cfg, shape, hw, device_type=named_device(cfg, hw),
                              warm=compile_warm,
                              tokens_per_card=trained_tokens_per_card(workload))
    step, exposed = step_time(shape, compiled_rate(hw, compiled), workload, actions,
                              req_row.generation_seconds, memory=memory, elastic_pool=elastic,
                              given=wl_cfg.step_seconds, ref=ref,
                              updates_per_step=cfg.actor.updates_per_step)
    switch = switch_summary(actions, step["seconds"], exposed=exposed)
    verdict = decide(shape, parallel, memory, hw, workload=workload, dtypes=dtypes, ref=ref,
                     utilization=util, pinned_per_node=pinned_per_node, sync_seconds=sync_seconds,
                     generation_seconds=req_row.generation_seconds,
                     tail_seconds=req_row.tail_seconds, step_seconds=step["seconds"])
    memory_owners = memory_by_owner(shape, parallel, memory, hw, kv_pool_bytes=pool,
                                    dtypes=dtypes, ref=ref)
    if not verdict.fits and advise and verdict.runnable:
        verdict.advice = find_fitting_plan(
            dataclasses.replace(cfg, parallel=parallel),
            lambda trial: build_plan(trial, ref=ref, grad_offload=grad_offload,
                                     advise=False)["verdict"])
        verdict.fix = f"{verdict.fix}; {advice_text(verdict.advice)}"
    options = None
    if advise:
        options = offload_options(dataclasses.replace(cfg, parallel=parallel),
                                  lambda trial: build_plan(trial, ref=ref,
                                                           grad_offload=grad_offload,
                                                           advise=False))
    return {
        "model": {"name": shape.name, "params": shape.num_params,
                  "active_params": shape.active_params, "layers": shape.num_layers,
                  "experts": shape.num_experts, "kv_bytes_per_token": shape.kv_bytes_per_token},
        "hardware": hw.to_dict(),
        "layout": {"gpus": parallel.gpus, "shard_size": shard_size(parallel), "tp": parallel.tp,
                   "tp_auto": auto_tp_size, "cards_per_node": cards_per_node},
        "offload": {"param": memory.param_offload, "optimizer": memory.optimizer_offload,
                    "grad": grad_offload, "ref": ref, "ref_offload": memory.ref_offload},
        "workload": {"prompt_len": workload.prompt_len, "response_len": workload.response_len,
                     "max_response_len": workload.max_response_len,
                     "tokens_per_card": workload.tokens_per_card,
                     "step_seconds": wl_cfg.step_seconds, "utilization": util,
                     "kv_pool": cfg.rollout.kv_pool,
                     "max_num_seqs": workload.max_num_seqs,
                     "assumed": assumed},
        "memory": {**memory_owners,
                   "train_peak_bytes": training_peak_bytes(shape, shard_size(parallel), dtypes, hw),
                   "train_peak_limit_bytes": TRAIN_PEAK_FRACTION * hw.hbm_bytes},
        "switch": {**switch, "weight_sync_seconds": sync_seconds},
        "step": step,
        **kv_and_host(rows, hw, pinned_per_card=pinned_per_card,
                      pinned_per_node=pinned_per_node),
        "verdict": verdict.to_dict(),
        "offload_sets": options,
        "compile": compiled.to_dict(),
    }


def kv_and_host(rows: list, hw: HardwareProfile, *, pinned_per_card: int,
                pinned_per_node: int) -> dict:
    """A plan report's KV table and its pinned host memory (the full and the LoRA plan's)."""
    return {"kv": [r.to_dict() for r in rows], "kv_gain": generation_gain(rows),
            "pinned_host_bytes_per_card": pinned_per_card,
            "pinned_host_bytes_per_node": pinned_per_node,
            "pinned_host_fits": pinned_per_node <= HOST_FRACTION * hw.host_ram_bytes,
            "host_ram_bytes": hw.host_ram_bytes}


# `handoff plan` flag -> config key; a flag left at None keeps the config file's value.
PLAN_FLAGS = {
    "model": "model.path", "gpus": "parallel.gpus", "hardware": "hardware.name",
    "shard_size": "parallel.shard_size", "tp": "parallel.tp",
    "util": "rollout.gpu_memory_utilization", "param_offload": "memory.param_offload",
    "optimizer_offload": "memory.optimizer_offload", "ref_offload": "memory.ref_offload",
    "prompt_len": "workload.prompt_len", "response_len": "workload.response_len",
    "max_response_len": "workload.max_response_len",
    "tokens_per_step": "workload.tokens_per_step", "step_seconds": "workload.step_seconds",
    "host_ram_gb": "hardware.host_ram_gb", "hbm_gb": "hardware.hbm_gb",
    "pcie_gbps": "hardware.pinned_pcie_gbps", "nvlink_gbps": "hardware.nvlink_gbps",
    "decode_tbps": "hardware.decode_bw_tbps", "activation_gb": "hardware.activation_peak_gb",
    "graph_pool_gb": "hardware.graph_pool_gb", "resident_gb": "hardware.resident_gb",
    "train_activation_gb": "hardware.train_activation_gb",
    "train_tflops": "hardware.train_tflops", "kl_coef": "actor.kl_coef",
    "lora_rank": "actor.lora.rank",
}


def plan_config(config_path: str | None, overrides: list[str] | None,
                flags: dict) -> tuple[Config, bool]:
    """The config of a `handoff plan` call and whether the engine TP is left to `auto_tp`."""
    from handoff.config import load_config

    extra = [f"{PLAN_FLAGS[k]}={v}" for k, v in flags.items() if k in PLAN_FLAGS and v is not None]
    cfg = load_config(config_path, list(overrides or []) + extra)
    tp_given = flags.get("tp") is not None or config_path is not None or any(
        o.split("=", 1)[0].strip() == "parallel.tp" for o in overrides or [])
    return cfg, not tp_given
