"""`handoff plan --lora-rank R`: LoRA on one copy of the base, priced (plan/lora.py,
plan/lora_verdict.py, plan/lora_report.py, plan.order's `lora` mode)."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from handoff.cli import app
from handoff.config import LORA_TARGETS, MemoryConfig, load_config
from handoff.errors import ConfigError, HandoffError
from handoff.plan.hardware import hardware_profile
from handoff.plan.ledger import SWITCH_ACTIONS, Dtypes, exposed_seconds
from handoff.plan.lora import (BaseCopies, adapter_params, adapter_sync_seconds,
                               adapter_tensors, lora_switch_actions, projection_shapes)
from handoff.plan.lora_report import build_lora_plan
from handoff.plan.order import switch_order
from handoff.plan.report import build_plan
from handoff.plan.shapes import PRESETS, load_shape, shape_from_config

runner = CliRunner()

# hidden 64, 4 heads and 2 KV heads of 16, MLP 128, 2 layers
TINY = {**PRESETS["tiny-qwen3"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 256}


def _cfg(model, *extra, rank=16, hardware="h200", gpus=1):
    return load_config(None, [f"model.path={model}", f"hardware.name={hardware}",
                              f"parallel.gpus={gpus}", f"actor.lora.rank={rank}", *extra])


def test_adapter_params_of_a_tiny_shape_by_hand():
    shape = shape_from_config(TINY, "tiny")
    assert set(projection_shapes(shape)) == set(LORA_TARGETS)
    # rank 4, rank x (in + out) per Linear: q 4x(64+64)=512, k and v 4x(64+32)=384 each,
    # o 512, gate and up 4x(64+128)=768 each, down 768: 4096 per layer, 2 layers.
    assert adapter_params(shape, 4, LORA_TARGETS) == 8192
    assert adapter_params(shape, 4, ["q_proj", "v_proj"]) == 2 * (512 + 384)
    assert adapter_params(shape, 4, ["q_proj", "q_proj"]) == 2 * 512   # one adapter per Linear
    assert adapter_params(shape, 8, ["down_proj"]) == 2 * 8 * (128 + 64)
    assert adapter_tensors(shape, ["q_proj", "v_proj"]) == 2 * 2 * 2   # A and B, 2 layers


def test_a_moe_model_is_refused_in_one_line():
    with pytest.raises(HandoffError, match="dense decoders.*plan it without --lora-rank"):
        adapter_params(load_shape("qwen3-30b-a3b"), 16, LORA_TARGETS)


def test_the_base_is_counted_once_no_reference_no_second_copy():
    cfg = _cfg("qwen3-8b", "actor.kl_coef=0.1")
    plan = build_lora_plan(cfg, advise=False)
    shape = load_shape("qwen3-8b")
    base = 2 * shape.num_params
    n = plan["lora"]["adapter_params"]
    assert n == adapter_params(shape, 16, LORA_TARGETS)
    train, gen = plan["memory"]["train"], plan["memory"]["generate"]
    # The trainer holds no params, grads or reference of the base: only the adapters' state.
    assert set(train) == {"base", "adapter_params", "adapter_grads", "adapter_optimizer",
                          "activations", "cuda_graph_pool", "resident"}
    assert train["base"] == gen["base"] == base
    assert [train["adapter_params"], train["adapter_grads"], train["adapter_optimizer"]] == \
        [2 * n, 2 * n, 12 * n]
    assert gen["engine_adapters"] == 2 * n and gen["trainer_left"] == 2 * n   # Adam offloaded
    hw = hardware_profile("h200", cfg.hardware)
    assert plan["memory"]["train_peak_bytes"] == base + 16 * n + hw.train_activation_bytes
    # The full-parameter plan of the same config holds the base three times on the card
    # (params, reference, engine weights) at some point of the step.
    full = build_plan(_cfg("qwen3-8b", "actor.kl_coef=0.1", rank=0), advise=False)
    assert full["memory"]["train"]["reference"] == full["memory"]["train"]["params"] == base


def test_the_switch_moves_the_kv_and_the_adapters_only():
    cfg = _cfg("qwen3-8b")
    plan = build_lora_plan(cfg, advise=False)
    n = plan["lora"]["adapter_params"]
    acts = {a["name"]: a for a in plan["switch"]["actions"]}
    assert [a["name"] for a in plan["switch"]["actions"]] == list(SWITCH_ACTIONS)
    for name in ("params_d2h", "params_h2d", "ref_d2h", "ref_h2d"):
        assert acts[name]["bytes_per_card"] == 0 and acts[name]["seconds"] == 0
    assert acts["engine_weights_sync"]["bytes_per_card"] == 2 * n
    assert acts["optimizer_d2h"]["bytes_per_card"] == acts["optimizer_h2d"]["bytes_per_card"] \
        == 12 * n
    assert plan["switch"]["total_bytes_per_card"] == 24 * n
    pool = plan["memory"]["generate"]["kv_pool"]
    hw = hardware_profile("h200", cfg.hardware)
    # The sleep unmaps the KV pool alone; the full-parameter sleep unmaps the weights too.
    assert acts["engine_sleep"]["seconds"] == pytest.approx(pool / hw.unmap_bps)
    assert acts["kv_cache_wake"]["bytes_per_card"] == pool
    kept = build_lora_plan(_cfg("qwen3-8b", "memory.optimizer_offload=false"), advise=False)
    assert kept["switch"]["total_bytes_per_card"] == 0
    assert kept["memory"]["generate"]["trainer_left"] == 14 * n   # params + master + Adam


def test_a_base_held_twice_is_backed_up_and_restored_and_only_the_adapters_synced():
    from handoff.plan.kvpool import engine_weight_bytes

    shape, hw = load_shape("qwen3-8b"), hardware_profile("h200")
    kw = dict(rank=16, targets=LORA_TARGETS, kv_pool_bytes=40e9)
    shared = {a.name: a for a in lora_switch_actions(shape, MemoryConfig(), hw, **kw)}
    bases = BaseCopies.of(shape, shares_base=False, shard=1, tp=1, param_offload=True)
    held = {a.name: a for a in lora_switch_actions(shape, MemoryConfig(), hw, bases=bases,
                                                   **kw)}
    weights = engine_weight_bytes(shape, 1, 2)
    adapters = adapter_params(shape, 16, LORA_TARGETS)
    # the adapters' sync: a tensor at the LoRA load's measured cost, else a full sync's
    loads = replace(hw, adapter_tensor_seconds=hw.sync_tensor_seconds / 4)
    tensors = adapter_tensors(shape, LORA_TARGETS)
    assert adapter_sync_seconds(shape, loads, rank=16, targets=LORA_TARGETS, dtypes=Dtypes()) \
        == pytest.approx(tensors * hw.sync_tensor_seconds / 4)
    assert adapter_sync_seconds(shape, hw, rank=16, targets=LORA_TARGETS, dtypes=Dtypes()) \
        == pytest.approx(tensors * hw.sync_tensor_seconds)
    assert held["engine_sleep"].bytes_per_card == weights   # level 1: the base to the host
    # the pool maps beside neither the optimizer nor the params copy here (fixed pool)
    assert held["kv_cache_wake"].bytes_per_card == shared["kv_cache_wake"].bytes_per_card
    assert held["engine_sleep"].seconds == pytest.approx(   # the copy, then the base unmapped
        weights / hw.pinned_pcie_bps + weights / hw.unmap_bps + shared["engine_sleep"].seconds)
    assert held["engine_weights_sync"].bytes_per_card == weights + 2 * adapters
    assert held["engine_weights_sync"].seconds == pytest.approx(
        weights / hw.map_bps + weights / hw.pinned_pcie_bps + adapter_sync_seconds(
            shape, hw, rank=16, targets=LORA_TARGETS, dtypes=Dtypes()))
    # the measured H2D rate, where given, prices what comes back
    measured = {a.name: a for a in lora_switch_actions(shape, MemoryConfig(), hw, bases=bases,
                                                       h2d_bps=hw.pinned_pcie_bps / 2, **kw)}
    assert measured["params_h2d"].seconds == pytest.approx(2 * held["params_h2d"].seconds)
    assert measured["params_d2h"].seconds == held["params_d2h"].seconds
    # an elastic pool under overlap maps at its wake beside the params' copy to the host
    elastic = {a.name: a for a in lora_switch_actions(shape, MemoryConfig(), hw, bases=bases,
                                                      elastic_pool=True, **kw)}
    shared_elastic = {a.name: a for a in lora_switch_actions(shape, MemoryConfig(), hw,
                                                             elastic_pool=True, **kw)}
    assert shared_elastic["kv_cache_wake"].bytes_per_card - elastic["kv_cache_wake"].bytes_per_card \
        == held["params_d2h"].bytes_per_card
    # memory.param_offload moves the trainer's own frozen base (bf16) and the adapters
    for name in ("params_d2h", "params_h2d"):
        assert held[name].bytes_per_card == shape.num_params * 2 + 2 * adapters
        assert shared[name].bytes_per_card == 0
    kept = BaseCopies.of(shape, shares_base=False, shard=1, tp=1, param_offload=False)
    assert kept.kept_generating == kept.trainer == shape.num_params * 2
    kept_actions = lora_switch_actions(shape, MemoryConfig(param_offload=False), hw, bases=kept,
                                       **kw)
    assert [a.bytes_per_card for a in kept_actions if a.name.startswith("params")] == [0, 0]
    for name in ("optimizer_d2h", "optimizer_h2d", "ref_d2h", "ref_h2d"):   # the adapters' only
        assert held[name] == shared[name]


def test_a_run_with_its_own_base_is_planned_as_lora_not_as_full_parameter_training():
    """An 8B's full-parameter state (131 GB) does not fit an H200; LoRA with the base held
    twice does: the trainer's base through the update, the engine's on the host then."""
    base = ["model.path=qwen3-8b", "hardware.name=h200", "actor.lora.rank=16",
            "rollout.kv_pool=elastic"]
    twice = build_lora_plan(load_config(None, base + ["actor.lora.share_base=false"]),
                            advise=False)
    shared = build_lora_plan(load_config(None, base), advise=False)
    assert twice["verdict"]["fits"] and twice["lora"]["share_base"] is False
    assert twice["memory"]["train_peak_bytes"] == shared["memory"]["train_peak_bytes"]
    gen = twice["memory"]["generate"]
    # param_offload on (the default): the trainer's base waits on the host, the engine's
    # base is backed up there at each sleep
    assert gen["trainer_left"] == shared["memory"]["generate"]["trainer_left"]
    assert twice["pinned_host_bytes_per_card"] > shared["pinned_host_bytes_per_card"] + 2 * 16e9
    kept = build_lora_plan(load_config(None, base + ["actor.lora.share_base=false",
                                                     "memory.param_offload=false"]),
                           advise=False)
    left = kept["memory"]["generate"]["trainer_left"] - gen["trainer_left"]
    assert left == load_shape("qwen3-8b").num_params * 2   # its own base stays beside the pool
    # the elastic pool maps what is left: smaller by that base
    assert shared["memory"]["generate"]["kv_pool"] - kept["memory"]["generate"]["kv_pool"] == \
        pytest.approx(left, rel=0.01)


@pytest.mark.parametrize("overlap, elastic", [(True, True), (True, False), (False, False)])
def test_the_lora_order_moves_no_base_and_the_ledger_prices_it(overlap, elastic):
    memory = MemoryConfig(overlap=overlap)
    order = switch_order(memory, ref=True, elastic_pool=elastic, lora=True)
    assert order.mode == "lora"
    assert [m.action for m in order.moves if m.action not in ("optimizer_h2d", "optimizer_d2h")] \
        == ["engine_sleep", "engine_weights_sync", "kv_cache_wake"]
    assert {m.action for m in order.moves} == {"engine_sleep", "optimizer_h2d",
                                              "engine_weights_sync", "kv_cache_wake",
                                              "optimizer_d2h"}
    assert (order.get("optimizer_d2h").phase == "generation") == (overlap and elastic)
    off = switch_order(MemoryConfig(optimizer_offload=False), ref=True, elastic_pool=elastic,
                       lora=True)
    assert [m.action for m in off.moves] == ["engine_sleep", "engine_weights_sync",
                                             "kv_cache_wake"]
    shape, hw = load_shape("qwen3-8b"), hardware_profile("h200")
    actions = lora_switch_actions(shape, memory, hw, rank=16, targets=LORA_TARGETS,
                                  kv_pool_bytes=50e9, elastic_pool=elastic)
    seconds = {a.name: a.seconds for a in actions}
    exposed = exposed_seconds(seconds, memory, compute_seconds=10.0, forward_seconds=5.0,
                              generation_seconds=100.0, elastic_pool=elastic, lora=True)
    # Streamed, the adapters' Adam comes back behind the ref's forward: nothing exposed.
    assert exposed["optimizer_h2d"] == (0.0 if overlap else seconds["optimizer_h2d"])


def test_qwen3_8b_fits_one_h200_with_lora_and_not_full_parameter():
    plan = build_lora_plan(_cfg("qwen3-8b"))
    # LoRA: 16.4 GB of base + 0.7 GB of adapter state + 4 GB activations, far under 130.6 GB;
    # full-parameter: 16 B x 8.2B = 131 GB of trainer state alone, over the limit.
    assert plan["verdict"]["fits"] and plan["lora"]["full_parameter_fits"] is False
    assert plan["lora"]["advice"] == ("qwen3-8b fits 1 x h200 with LoRA rank 16, not without it "
                                      "(full-parameter training does not fit)")
    full = build_plan(_cfg("qwen3-8b", rank=0), advise=False)
    assert not full["verdict"]["fits"]
    assert plan["memory"]["generate"]["kv_pool"] > 0
    # A frozen base's backward computes the activations' gradients only: 4 N T, not 6 N T.
    assert plan["step"]["train_flops_per_card"] == pytest.approx(
        full["step"]["train_flops_per_card"] * 4 / 6)


def test_qwen3_32b_with_lora_fits_one_h200_but_not_one_80gb_card():
    plan = build_lora_plan(_cfg("qwen3-32b"))
    # 65.5 GB of base + 2.1 GB of adapter state + 4 GB of activations = 71.7 GB: under the
    # H200's 130.6 GB limit, over the 80 GB card's 70 GB.
    assert plan["verdict"]["fits"], plan["verdict"]["reasons"]
    assert plan["verdict"]["max_utilization"] == 0.94
    assert plan["memory"]["train_peak_bytes"] / 1e9 == pytest.approx(71.7, abs=0.05)
    small = build_lora_plan(_cfg("qwen3-32b", hardware="h100-sxm"))
    assert not small["verdict"]["fits"]
    assert "the base must fit one card" in small["verdict"]["fix"]
    assert small["lora"]["advice"].endswith("nor without it (full-parameter)")


def test_a_tp_engine_is_not_planned_under_lora_and_the_advice_is_tp_1():
    plan = build_lora_plan(_cfg("qwen3-8b", "parallel.tp=2", gpus=2))
    assert not plan["verdict"]["fits"]
    assert "pass --tp 1" in plan["verdict"]["fix"]
    assert plan["verdict"]["advice"]["overrides"] == ["parallel.tp=1"]
    # Two H200s hold 8B's full-parameter state (65.5 GB a card): the line says so.
    assert plan["lora"]["advice"].endswith("but fits without it (full-parameter)")


def test_a_utilization_that_leaves_no_pool_is_advised_the_safe_one_and_rechecked():
    plan = build_lora_plan(_cfg("qwen3-32b", "rollout.gpu_memory_utilization=0.3"))
    # 0.3 x 149 GB = 44.8 GB cannot hold the 65.5 GB base: the highest safe 0.94 can.
    assert not plan["verdict"]["fits"]
    assert plan["verdict"]["advice"]["overrides"] == ["rollout.gpu_memory_utilization=0.94"]
    assert plan["lora"]["to_fit"].startswith("it fits with --util 0.94")
    fixed = build_lora_plan(_cfg("qwen3-32b", "rollout.gpu_memory_utilization=0.94"))
    assert fixed["verdict"]["fits"]
    none = build_lora_plan(_cfg("qwen3-32b", hardware="h100-sxm"))
    assert none["verdict"]["advice"] is None
    assert none["lora"]["to_fit"].startswith("no LoRA plan fits these cards")


def test_the_cli_prints_the_lora_lines():
    res = runner.invoke(app, ["plan", "--lora-rank", "16", "--model", "qwen3-8b", "--gpus", "1",
                              "--hardware", "h200"])
    assert res.exit_code == 0, res.output
    assert "LoRA rank 16 (alpha 16)" in res.output
    assert "LoRA: qwen3-8b fits 1 x h200 with LoRA rank 16, not without it" in res.output
    assert "engine_adapters" in res.output and "adapter_optimizer" in res.output
    as_json = json.loads(runner.invoke(app, ["plan", "--lora-rank", "16", "--model", "qwen3-8b",
                                             "--hardware", "h200", "--json"]).output)
    assert as_json["lora"]["rank"] == 16 and as_json["memory"]["train"]["base"] > 0


def test_rank_0_plans_are_the_full_parameter_plans_whatever_the_other_lora_keys():
    base = ["plan", "--model", "qwen3-8b", "--gpus", "1", "--hardware", "h200", "--json"]
    plain = runner.invoke(app, base)
    zero = runner.invoke(app, base + ["--lora-rank", "0", "actor.lora.alpha=64",
                                      "actor.lora.target_modules=[q_proj]"])
    assert plain.output == zero.output and "lora" not in json.loads(plain.output)


def test_bad_lora_settings_are_one_line():
    with pytest.raises(ConfigError, match="x_proj' is not accepted: choose one of q_proj"):
        load_config(None, ["actor.lora.target_modules=[q_proj,x_proj]"])
    with pytest.raises(ConfigError, match="no actor.lora.target_modules"):
        load_config(None, ["actor.lora.rank=8", "actor.lora.target_modules=[]"])


def test_a_rank_above_the_hidden_size_is_refused_by_plan_and_train(tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app
    from handoff.modelzoo import init_model

    result = CliRunner().invoke(app, ["plan", "--model", "qwen3-8b", "--lora-rank", "100000"],
                                terminal_width=300)
    assert result.exit_code == 2
    assert "actor.lora.rank=100000 is above the model's hidden size 4096" in result.output
    model = init_model("tiny-qwen3", tmp_path / "m", dtype="float32")
    result = CliRunner().invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model}",
                                      f"run.out_dir={tmp_path / 'run'}", "actor.lora.rank=4096"],
                                terminal_width=300)
    assert result.exit_code == 2 and "is above the model's hidden size" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("share_base", [True, False])
def test_the_engines_adapters_are_counted_as_the_engine_sizes_them(share_base):
    """The engine keeps a slot (A and B at the rank) for all seven projections whatever the
    targets; held twice, the A rows beside its weights count with the weights, once."""
    from handoff.plan.lora import engine_adapter_rows

    shape = load_shape("qwen3-8b")
    bases = BaseCopies.of(shape, shares_base=share_base, shard=1, tp=1, param_offload=False,
                          rank=16)
    slots = 2 * adapter_params(shape, 16, LORA_TARGETS)
    rows = 2 * engine_adapter_rows(shape, 16, tp=1)
    assert bases.engine_adapters == (slots if share_base else slots - rows)
    from handoff.plan.kvpool import engine_weight_bytes
    assert bases.engine == (2 * shape.num_params if share_base
                            else engine_weight_bytes(shape, 1, 2) + rows)
    cfg = _cfg("qwen3-8b", "actor.lora.target_modules=[q_proj,v_proj]",
               f"actor.lora.share_base={str(share_base).lower()}")
    gen = build_lora_plan(cfg, advise=False)["memory"]["generate"]
    assert gen["engine_adapters"] == bases.engine_adapters   # not the two targets' adapters
    assert gen["engine_adapters"] > 2 * adapter_params(shape, 16, ["q_proj", "v_proj"])
