"""`handoff plan --lora-rank R`: the plan of LoRA on one copy of the base, as one report.

    report = build_lora_plan(load_config(None, ["model.path=qwen3-8b", "actor.lora.rank=16",
                                                "hardware.name=h200"]))
    report["lora"]["advice"], report["verdict"]["fits"]

The report has build_plan's keys (the `--json` contract, plan/report.py) with LoRA's owners
and actions (plan/lora.py, plan/lora_verdict.py), no offload sets (the adapters' optimizer
state is the one thing to offload, and the ledger prices it either way), plus `lora`: {rank,
alpha, target_modules, adapter_params, adapter_bytes, base_bytes, full_parameter_fits,
advice, to_fit}: the advice line says whether the model fits these cards with LoRA, without it
(full-parameter training, planned alike), both or neither; to_fit (a plan that does not fit)
the least change that re-plans to a LoRA fit (plan.advice.find_fitting_lora_plan), or why
none does; verdict.advice holds that change as overrides.
"""

from __future__ import annotations

import copy
import dataclasses

from handoff.config import Config
from handoff.errors import HandoffError
from handoff.plan.advice import advice_text, find_fitting_lora_plan
from handoff.plan.compile import choose_compile, compiled_rate, named_device
from handoff.plan.hardware import hardware_profile
from handoff.plan.kvpool import kv_pool_bytes, kv_table
from handoff.plan.ledger import Dtypes, offloaded_bytes_per_card, shard_size, switch_summary
from handoff.plan.lora import (BaseCopies, adapter_params, adapter_sync_seconds, base_bytes,
                               lora_memory_by_owner, lora_switch_actions)
from handoff.plan.lora_verdict import (decide_lora, lora_elastic_utilization,
                                       lora_max_safe_utilization, lora_training_peak_bytes)
from handoff.plan.report import (auto_tp, build_plan, kv_and_host, plan_workload, step_time,
                                 trained_tokens_per_card)
from handoff.plan.shapes import load_shape
from handoff.plan.verdict import TRAIN_PEAK_FRACTION

NO_LORA_FIT = ("no LoRA plan fits these cards at any utilization, with or without the adapters' "
               "optimizer offloaded: the base must fit one card beside the adapters' state, the "
               "activations and a KV pool; pick larger cards")


def lora_advice(name: str, gpus: int, hardware: str, rank: int, *, lora_fits: bool,
                full_fits: bool | None) -> str:
    """One line: whether the model fits these cards with LoRA rank `rank`, and without it."""
    where = f"{name} {'fits' if lora_fits else 'does not fit'} {gpus} x {hardware} with LoRA " \
            f"rank {rank}"
    if full_fits is None:
        return where
    if lora_fits:
        return where + (", and without it (full-parameter)" if full_fits
                        else ", not without it (full-parameter training does not fit)")
    return where + (", but fits without it (full-parameter)" if full_fits
                    else ", nor without it (full-parameter)")


def check_rank(rank: int, hidden: int) -> None:
    """A LoRA rank is at most the width of the projections it adapts (their least is the
    hidden size): above it the adapter is no longer low-rank, and its state larger than the
    layer's."""
    if rank > hidden:
        raise HandoffError(f"actor.lora.rank={rank} is above the model's hidden size {hidden}: "
                           "a LoRA rank is at most a projection's width; use 8-128")


def build_lora_plan(cfg: Config, *, ref: bool | None = None, grad_offload: bool = False,
                    auto_tp_size: bool = False, advise: bool = True,
                    compile_warm: bool = False) -> dict:
    """Every table of `handoff plan` in LoRA mode (actor.lora.rank > 0) as one dict; with
    `advise`, the full-parameter plan of the same config decides the advice line. A
    reference forward is priced when `ref` (default: actor.kl_coef > 0); it holds no bytes.
    `compile_warm`: as build_plan's."""
    ref = cfg.actor.kl_coef > 0 if ref is None else ref
    lora = cfg.actor.lora
    shape = load_shape(cfg.model.path)
    check_rank(lora.rank, shape.hidden_size)
    hw = hardware_profile(cfg.hardware.name, cfg.hardware)
    dtypes = Dtypes.for_model(cfg.model.dtype, cfg.rollout.kv_dtype)
    parallel = dataclasses.replace(cfg.parallel)
    if auto_tp_size and lora.shares_base:
        parallel.tp = 1   # the base shared with the trainer is whole on each card
    elif auto_tp_size:
        parallel.tp = auto_tp(shape, hw, parallel.gpus, dtypes)
    memory = cfg.memory
    bases = BaseCopies.of_run(shape, lora, memory, parallel, dtypes)
    adapters = adapter_params(shape, lora.rank, lora.target_modules)
    elastic = cfg.rollout.kv_pool == "elastic"
    util = (round(lora_elastic_utilization(adapters, memory, hw, dtypes, bases), 4) if elastic
            else cfg.rollout.gpu_memory_utilization)
    workload, assumed = plan_workload(cfg, parallel.gpus, hw)
    engine_adapters = bases.engine_adapters
    weights = bases.engine + engine_adapters
    pool = kv_pool_bytes(util, hw, weights)
    actions = lora_switch_actions(shape, memory, hw, rank=lora.rank, targets=lora.target_modules,
                                  kv_pool_bytes=pool, dtypes=dtypes,
                                  grad_offload=grad_offload, elastic_pool=elastic, bases=bases)
    cards_per_node = min(parallel.gpus, hw.gpus_per_node)
    pinned_per_card = offloaded_bytes_per_card(actions)
    pinned_per_node = cards_per_node * pinned_per_card
    sync_seconds = adapter_sync_seconds(shape, hw, rank=lora.rank, targets=lora.target_modules,
                                        dtypes=dtypes)
    best = lora_max_safe_utilization(adapters, memory, hw, dtypes, bases)
    rows = kv_table(shape, hw, tp=parallel.tp, workload=workload, requested=util,
                    best=best if best > 0 else None, weight_bytes=dtypes.engine_bytes,
                    kv_bytes=dtypes.kv_bytes, extra_weight_bytes=engine_adapters)
    req_row = next(r for r in rows if r.requested)
    compiled = choose_compile(cfg, shape, hw, device_type=named_device(cfg, hw),
                              warm=compile_warm,
                              tokens_per_card=trained_tokens_per_card(workload))
    step, exposed = step_time(shape, compiled_rate(hw, compiled), workload, actions,
                              req_row.generation_seconds, memory=memory, elastic_pool=elastic,
                              given=cfg.workload.step_seconds, ref=ref,
                              updates_per_step=cfg.actor.updates_per_step, lora=True,
                              lora_order=bases.shared)
    verdict = decide_lora(shape, parallel, memory, hw, adapters=adapters, workload=workload,
                          utilization=util, pinned_per_node=pinned_per_node,
                          sync_seconds=sync_seconds, generation_seconds=req_row.generation_seconds,
                          tail_seconds=req_row.tail_seconds, step_seconds=step["seconds"],
                          dtypes=dtypes, bases=bases)
    full_fits = None
    if advise:
        full = copy.deepcopy(cfg)
        full.actor.lora.rank = 0
        full_fits = build_plan(full, ref=ref, grad_offload=grad_offload,
                               auto_tp_size=auto_tp_size, advise=False)["verdict"]["fits"]
    advice = lora_advice(shape.name, parallel.gpus, hw.name, lora.rank, lora_fits=verdict.fits,
                         full_fits=full_fits)
    to_fit = None
    if not verdict.fits:
        if advise and verdict.runnable:
            verdict.advice = find_fitting_lora_plan(
                dataclasses.replace(cfg, parallel=parallel),
                lambda trial: build_lora_plan(trial, ref=ref, grad_offload=grad_offload,
                                              advise=False)["verdict"])
        to_fit = advice_text(verdict.advice) if verdict.advice else NO_LORA_FIT
        verdict.fix = f"{verdict.fix}; {to_fit}; {advice}"
    return {
        "model": {"name": shape.name, "params": shape.num_params,
                  "active_params": shape.active_params, "layers": shape.num_layers,
                  "experts": shape.num_experts, "kv_bytes_per_token": shape.kv_bytes_per_token},
        "hardware": hw.to_dict(),
        "layout": {"gpus": parallel.gpus, "shard_size": 1 if bases.shared else
                   shard_size(parallel), "tp": parallel.tp,
                   "tp_auto": auto_tp_size, "cards_per_node": cards_per_node},
        "offload": {"param": memory.param_offload and not bases.shared,
                    "optimizer": memory.optimizer_offload, "grad": grad_offload,
                    "ref": ref, "ref_offload": False},
        "workload": {"prompt_len": workload.prompt_len, "response_len": workload.response_len,
                     "max_response_len": workload.max_response_len,
                     "tokens_per_card": workload.tokens_per_card,
                     "step_seconds": cfg.workload.step_seconds, "utilization": util,
                     "kv_pool": cfg.rollout.kv_pool, "max_num_seqs": workload.max_num_seqs,
                     "assumed": assumed},
        "memory": {**lora_memory_by_owner(shape, memory, hw, adapters=adapters,
                                          kv_pool_bytes=pool, dtypes=dtypes, bases=bases),
                   "train_peak_bytes": lora_training_peak_bytes(shape, adapters, dtypes, hw,
                                                                bases),
                   "train_peak_limit_bytes": TRAIN_PEAK_FRACTION * hw.hbm_bytes},
        "switch": {**switch_summary(actions, step["seconds"], exposed=exposed),
                   "weight_sync_seconds": sync_seconds},
        "step": step,
        **kv_and_host(rows, hw, pinned_per_card=pinned_per_card,
                      pinned_per_node=pinned_per_node),
        "verdict": verdict.to_dict(),
        "offload_sets": None,
        "compile": compiled.to_dict(),
        "lora": {"rank": lora.rank, "alpha": lora.alpha,
                 "target_modules": list(lora.target_modules),
                 "adapter_params": adapters, "adapter_bytes": engine_adapters,
                 "base_bytes": base_bytes(shape, dtypes), "share_base": bases.shared,
                 "full_parameter_fits": full_fits, "advice": advice, "to_fit": to_fit},
    }
