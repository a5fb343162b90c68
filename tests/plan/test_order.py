"""The switch order as data (plan.order): what each mode runs where, and the ledger pricing
the moves it runs behind work from it."""

import pytest

from handoff.config import MemoryConfig
from handoff.plan.ledger import SWITCH_ACTIONS, exposed_seconds
from handoff.plan.order import HOWS, PHASES, switch_order


def _actions(order):
    return [(m.action, m.phase, m.how) for m in order.moves]


def test_the_sequential_order_waits_for_every_move_where_it_starts():
    order = switch_order(MemoryConfig(overlap=False), ref=True, elastic_pool=True)
    assert order.mode == "sequential"
    assert _actions(order) == [
        ("engine_sleep", "to_train", "wait"), ("params_h2d", "to_train", "wait"),
        ("ref_h2d", "ref_forward", "wait"), ("ref_d2h", "ref_forward", "wait"),
        ("optimizer_h2d", "update", "wait"), ("optimizer_d2h", "to_rollout", "start"),
        ("engine_weights_sync", "to_rollout", "wait"), ("params_d2h", "to_rollout", "wait"),
        ("kv_cache_wake", "to_rollout", "wait")]
    assert order.get("params_h2d").by_kernel and order.get("ref_h2d").by_kernel


def test_streamed_with_an_elastic_pool_runs_copies_behind_work():
    order = switch_order(MemoryConfig(overlap=True), ref=True, elastic_pool=True)
    assert [m.action for m in order.behind("first_pass")] == ["params_h2d", "optimizer_h2d"]
    assert [m.action for m in order.behind("generation")] == ["optimizer_d2h", "params_d2h"]
    assert order.get("ref_d2h").how == "drop"
    fixed = switch_order(MemoryConfig(overlap=True), ref=True, elastic_pool=False)
    assert fixed.at("generation") == () and fixed.get("optimizer_d2h").phase == "to_rollout"


@pytest.mark.parametrize("ref, updates", [(False, 1), (True, 2)])
def test_with_the_actors_forward_first_the_params_come_back_by_kernel_first(ref, updates):
    order = switch_order(MemoryConfig(overlap=True), ref=ref, elastic_pool=True,
                         updates_per_step=updates)
    params = order.get("params_h2d")
    assert (params.phase, params.how, params.by_kernel) == ("to_train", "start", True)
    assert [m.action for m in order.behind("first_pass")] == ["optimizer_h2d"]


def test_offloads_turned_off_have_no_move_and_every_move_is_known():
    for overlap in (False, True):
        for elastic in (False, True):
            mem = MemoryConfig(overlap=overlap, param_offload=False, ref_offload=False)
            order = switch_order(mem, ref=True, elastic_pool=elastic)
            names = [m.action for m in order.moves]
            assert "params_h2d" not in names and "params_d2h" not in names
            assert "ref_h2d" not in names
            assert {m.phase for m in order.moves} <= set(PHASES)
            assert {m.how for m in order.moves} <= set(HOWS)
            assert set(names) <= set(SWITCH_ACTIONS) and len(names) == len(set(names))


def test_the_ledger_exposes_the_moves_behind_work_by_what_they_outlast():
    seconds = dict.fromkeys(SWITCH_ACTIONS, 1.0)
    seconds.update(params_h2d=0.5, optimizer_h2d=2.0, optimizer_d2h=2.0, params_d2h=0.5)
    exposed = exposed_seconds(seconds, MemoryConfig(overlap=True), compute_seconds=9.0,
                              forward_seconds=1.5, generation_seconds=2.25,
                              elastic_pool=True, ref=True)
    # Behind the ref's forward (1.5 s), in turn: params 0.5 (hidden), optimizer 2.0 (1.0 late).
    assert exposed["params_h2d"] == 0.0 and exposed["optimizer_h2d"] == 1.0
    # Behind generation (2.25 s): optimizer 2.0 (hidden), params 0.5 (0.25 late).
    assert exposed["optimizer_d2h"] == 0.0 and exposed["params_d2h"] == 0.25
    assert exposed["engine_sleep"] == 1.0 and exposed["ref_h2d"] == 1.0
    sequential = exposed_seconds(seconds, MemoryConfig(overlap=False), compute_seconds=9.0,
                                 forward_seconds=1.5, generation_seconds=2.25,
                                 elastic_pool=True, ref=True)
    assert sequential == seconds
