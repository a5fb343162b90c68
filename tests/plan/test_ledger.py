"""The ledger against the source: the 32B / 8-card switch table, the five-row switch-to-step
table, the first memory table and the 520 GB of pinned host RAM; plus the runtime contract.

Every expected figure is the source's printed string; the computed side comes from the
formulas (bytes = N x dtype size / shard, seconds = bytes / rate) with the h100-sxm profile,
which holds the source's assumptions (pinned PCIe 25 GB/s, NVLink 450 GB/s).
"""

from dataclasses import replace

import pytest

from handoff.config import MemoryConfig, ParallelConfig
from handoff.plan.hardware import hardware_profile
from handoff.plan.kvpool import engine_weight_bytes, kv_pool_bytes
from handoff.plan.ledger import (SWITCH_ACTIONS, Dtypes, exposed_seconds, memory_by_owner,
                                 offloaded_bytes_per_card, switch_actions, switch_summary)
from handoff.plan.shapes import load_shape

GB = 1e9
H100 = hardware_profile("h100-sxm")


def plan_switch(model, gpus, *, shard=None, tp=None, util=0.5, **memory):
    shape = load_shape(model)
    parallel = ParallelConfig(gpus=gpus, shard_size=shard, tp=tp or min(gpus, 8))
    # The source's tables are of its switch, the sequential one: every copy waited for.
    mem = MemoryConfig(**{"overlap": False, **memory})
    pool = kv_pool_bytes(util, H100, engine_weight_bytes(shape, parallel.tp))
    return shape, parallel, mem, pool


def actions_for(model, gpus, *, shard=None, tp=None, grad_offload=False, **memory):
    shape, parallel, mem, pool = plan_switch(model, gpus, shard=shard, tp=tp, **memory)
    return switch_actions(shape, parallel, mem, H100, kv_pool_bytes=pool,
                          grad_offload=grad_offload)


def test_action_names_are_the_runtime_contract():
    assert SWITCH_ACTIONS == ("optimizer_d2h", "params_d2h", "ref_d2h", "engine_weights_sync",
                              "kv_cache_wake", "engine_sleep", "params_h2d", "optimizer_h2d",
                              "ref_h2d")
    assert [a.name for a in actions_for("qwen3-32b", 8)] == list(SWITCH_ACTIONS)


def test_switch_table_32b_8_cards(published):
    """Source table: 49 / 8 / 8 GB at 2.0 / 0.3 / 0.3 s each way, sync ~1 s, remaps ~0.1 s,
    total ~130 GB over PCIe, ~6.5 s, ~2% of a 300 s step."""
    acts = {a.name: a for a in actions_for("qwen3-32b", 8)}
    for name, gb, secs in [("optimizer_d2h", "49", "2.0"), ("params_d2h", "8", "0.3"),
                           ("ref_d2h", "8", "0.3"), ("params_h2d", "8", "0.3"),
                           ("optimizer_h2d", "49", "2.0"), ("ref_h2d", "8", "0.3")]:
        published(acts[name].bytes_per_card / GB, gb, 0.05, name)
        published(acts[name].seconds, secs, 0.05, name)
        assert acts[name].link == "PCIe"
    published(acts["engine_weights_sync"].bytes_per_card / GB, "8", 0.05, "sync bytes written")
    published(acts["engine_weights_sync"].seconds, "1", 0.25, "sync seconds")
    published(acts["kv_cache_wake"].bytes_per_card / GB, "30", 0.05, "KV mapped")
    published(acts["kv_cache_wake"].seconds, "0.1", 0.25, "KV remap")
    published(acts["engine_sleep"].seconds, "0.1", 0.3, "sleep")
    assert acts["engine_sleep"].bytes_per_card == 0
    total = switch_summary(list(acts.values()), step_seconds=300)
    published(total["total_bytes_per_card"] / GB, "130", 0.05, "total bytes")
    published(total["total_seconds"], "6.5", 0.05, "total seconds")
    published(total["share_of_step"] * 100, "2", 0.1, "share of a 300 s step (%)")


def test_memory_table_32b_8_cards(published):
    shape, parallel, mem, pool = plan_switch("qwen3-32b", 8)
    owners = memory_by_owner(shape, parallel, mem, H100, kv_pool_bytes=pool)
    for owner, gb in [("params", "8.2"), ("grads", "8.2"), ("optimizer", "49.2"),
                      ("reference", "8.2")]:
        published(owners["train"][owner] / GB, gb, 0.01, owner)
    published(owners["generate"]["engine_weights"] / GB, "8.2", 0.01, "engine weights")
    published(owners["generate"]["kv_pool"] / GB, "30", 0.05, "KV pool 0.5 x 80 - 8.2 - act")
    # Together more than 120 GB on an 80 GB card: the memory must change hands twice per step.
    both = sum(owners["train"].values()) + sum(
        owners["generate"][k] for k in ("engine_weights", "kv_pool", "activation_peak",
                                        "cuda_graph_pool"))
    assert both > 120 * GB


def test_pinned_host_520_gb(published):
    per_card = offloaded_bytes_per_card(actions_for("qwen3-32b", 8))
    published(8 * per_card / GB, "520", 0.02, "8 cards x (8 + 49 + 8) GB")


# The five-row switch-to-step table. Its rows use the source's quick formula per direction,
# 16N/n (optimizer offload; else 2N/n) + 2N/n (ref): 16N/n counts the whole training state,
# grads included, so those rows run with grad_offload. The 32B / 8-card row instead repeats the
# action table (grads freed, 14N/n + 2N/n) and its time is that table's total (sync and remaps
# included); the other rows' times count the PCIe moves only.
FIVE_ROWS = [
    # model, cards, shard, optimizer offload, grad offload, GB per direction, s, step s, share %
    ("llama3-8b", 64, None, True, True, "2.3", "0.2", 810, "0.02"),
    ("qwen3-32b", 8, None, True, False, "65", "6.5", 300, "2"),
    ("qwen3-32b", 64, 8, False, False, "16", "1.3", 2400, "0.05"),
    ("deepseek-v3", 256, None, True, True, "47", "3.8", 650, "0.6"),
    ("llama3-8b", 16, None, True, True, "9", "0.7", 111, "0.6"),
]


@pytest.mark.parametrize("row", FIVE_ROWS, ids=lambda r: f"{r[0]}-{r[1]}")
def test_switch_to_step_table(row, published):
    model, cards, shard, opt, grad, gb, secs, step, share = row
    acts = actions_for(model, cards, shard=shard, tp=8 if model != "deepseek-v3" else 32,
                       optimizer_offload=opt, grad_offload=grad)
    summary = switch_summary(acts, step_seconds=step)
    per_direction = offloaded_bytes_per_card(acts)
    published(per_direction / GB, gb, 0.05, "bytes per card per direction")
    assert summary["total_bytes_per_card"] == 2 * per_direction
    seconds = summary["total_seconds"] if (model, cards) == ("qwen3-32b", 8) \
        else summary["host_link_seconds"]
    published(seconds, secs, 0.1, "switch seconds")
    published(100 * seconds / step, share, 0.1, "share of step (%)")


def test_offloads_off_give_zero_byte_actions():
    acts = {a.name: a for a in actions_for("qwen3-32b", 64, param_offload=False,
                                            optimizer_offload=False, ref_offload=False)}
    for name in ("optimizer_d2h", "params_d2h", "ref_d2h", "params_h2d", "optimizer_h2d",
                 "ref_h2d"):
        assert acts[name].bytes_per_card == 0 and acts[name].seconds == 0
        assert acts[name].note.startswith("off")
    assert acts["engine_weights_sync"].bytes_per_card > 0  # the engine still needs new weights


def test_one_card_bytes_are_exact():
    """The runtime asserts measured == planned on one card: bytes are N x dtype size."""
    shape = load_shape("tiny-qwen3")
    n = shape.num_params
    dtypes = Dtypes(param_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8,
                    engine_bytes=2)
    acts = {a.name: a for a in switch_actions(shape, ParallelConfig(gpus=1),
                                              MemoryConfig(overlap=False), H100,
                                              kv_pool_bytes=12345, dtypes=dtypes)}
    assert acts["optimizer_d2h"].bytes_per_card == 8 * n == acts["optimizer_h2d"].bytes_per_card
    assert acts["params_d2h"].bytes_per_card == 4 * n == acts["params_h2d"].bytes_per_card
    assert acts["ref_d2h"].bytes_per_card == 4 * n
    assert acts["engine_weights_sync"].bytes_per_card == 2 * n
    assert acts["engine_weights_sync"].link == "in-card copy"
    assert acts["kv_cache_wake"].bytes_per_card == 12345
    no_ref = switch_actions(shape, ParallelConfig(gpus=1), MemoryConfig(), H100,
                            kv_pool_bytes=0, dtypes=dtypes, ref=False)
    assert no_ref[2].bytes_per_card == 0 and no_ref[2].note == "no reference model"


def test_seconds_follow_the_link_rate():
    fast = hardware_profile("h100-sxm")
    shape, parallel, mem, pool = plan_switch("qwen3-32b", 8)
    slow = replace(fast, pinned_pcie_bps=fast.pinned_pcie_bps / 2)
    a = switch_actions(shape, parallel, mem, fast, kv_pool_bytes=pool)[0]
    b = switch_actions(shape, parallel, mem, slow, kv_pool_bytes=pool)[0]
    assert b.bytes_per_card == a.bytes_per_card
    assert b.seconds == pytest.approx(2 * a.seconds)


def test_the_streamed_switch_hides_its_copies_behind_work():
    """memory.overlap: the ref is never copied down again, the params' and the optimizer's
    copies back hide behind the forwards before the update, the copies to the host behind
    generation (elastic pool)."""
    shape, parallel, mem, pool = plan_switch("qwen3-32b", 8, overlap=True)
    acts = switch_actions(shape, parallel, mem, H100, kv_pool_bytes=pool)
    by_name = {a.name: a for a in acts}
    assert by_name["ref_d2h"].bytes_per_card == 0 < by_name["ref_h2d"].bytes_per_card
    # Its host copy still takes pinned RAM.
    assert offloaded_bytes_per_card(acts) == offloaded_bytes_per_card(actions_for("qwen3-32b", 8))
    raw = {a.name: a.seconds for a in acts}

    def exposed(memory=mem, *, forward=100.0, generation=100.0, elastic=True, ref=True,
                updates=1, compute=1000.0):
        return exposed_seconds(raw, memory, compute_seconds=compute, forward_seconds=forward,
                               generation_seconds=generation, elastic_pool=elastic, ref=ref,
                               updates_per_step=updates)

    assert exposed(MemoryConfig(overlap=False)) == raw
    # The params' and the optimizer's copies back queue behind the ref's, under its forward
    # (not under the update: the rest of the compute does not hide them).
    fixed = exposed(forward=raw["params_h2d"] + 1.0, elastic=False)
    assert fixed["params_h2d"] == 0
    assert fixed["optimizer_h2d"] == pytest.approx(raw["optimizer_h2d"] - 1.0)
    short = exposed(forward=raw["params_h2d"] / 2, elastic=False)
    assert short["params_h2d"] == pytest.approx(raw["params_h2d"] / 2)
    assert short["optimizer_h2d"] == pytest.approx(raw["optimizer_h2d"])
    for name in ("optimizer_d2h", "params_d2h"):   # a fixed pool maps after them
        assert fixed[name] == raw[name]
    hidden = exposed()
    assert hidden["optimizer_h2d"] == hidden["optimizer_d2h"] == hidden["params_d2h"] == 0
    assert hidden["params_h2d"] == 0
    for name in ("engine_weights_sync", "kv_cache_wake", "engine_sleep", "ref_h2d"):
        assert hidden[name] == raw[name]
    # Generation shorter than the two copies to the host (one stream: the params' last).
    half = raw["optimizer_d2h"] / 2
    late = exposed(generation=half)
    assert late["optimizer_d2h"] == pytest.approx(half)
    assert late["params_d2h"] == pytest.approx(raw["params_d2h"])
    assert exposed(generation=None)["optimizer_d2h"] == raw["optimizer_d2h"]   # unknown: all
    # The actor's forward first: its params come back by kernel before it (all exposed), the
    # optimizer behind the forwards before the update (the old policy's and the ref's) ...
    old_first = exposed(forward=raw["optimizer_h2d"] / 4, updates=2)
    assert old_first["params_h2d"] == raw["params_h2d"]
    assert old_first["optimizer_h2d"] == pytest.approx(raw["optimizer_h2d"] / 2)
    # ... or with no forward before the update, behind the update.
    no_ref = exposed(forward=100.0, ref=False, compute=raw["optimizer_h2d"] / 4)
    assert no_ref["params_h2d"] == raw["params_h2d"]
    assert no_ref["optimizer_h2d"] == pytest.approx(raw["optimizer_h2d"] * 3 / 4)


def test_the_plan_models_the_step_with_the_exposed_switch():
    from handoff.config import load_config
    from handoff.plan.report import build_plan

    base = ["model.path=qwen3-4b"]
    on = build_plan(load_config("examples/h200-4b.yaml", base), advise=False)
    off = build_plan(load_config("examples/h200-4b.yaml", base + ["memory.overlap=false"]),
                     advise=False)
    assert off["switch"]["exposed_seconds"] == pytest.approx(off["switch"]["total_seconds"])
    hidden = off["switch"]["total_seconds"] - on["switch"]["exposed_seconds"]
    assert hidden > 0.5   # the optimizer's 48 GB copy back and the ref's copy down
    assert on["step"]["switch_seconds"] == pytest.approx(on["switch"]["exposed_seconds"])
    assert off["step"]["seconds"] - on["step"]["seconds"] == pytest.approx(hidden)
    actions = {a["name"]: a for a in on["switch"]["actions"]}
    assert actions["optimizer_h2d"]["exposed_seconds"] == 0 < actions["optimizer_h2d"]["seconds"]
