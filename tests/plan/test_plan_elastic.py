"""`handoff plan` with rollout.kv_pool=elastic: the pool is what the trainer leaves (no
utilization to choose), more than the highest safe fixed utilization gives, and less when the
trainer keeps its state on the card."""

from handoff.config import load_config
from handoff.plan.render import summary_lines
from handoff.plan.report import build_plan


def _plan(*overrides):
    return build_plan(load_config("examples/h200-4b.yaml", ["model.path=qwen3-4b", *overrides]),
                      advise=False)


def _requested(report):
    return next(r for r in report["kv"] if r["requested"])


def test_elastic_pool_is_what_the_trainer_leaves():
    fixed = _plan()
    elastic = _plan("rollout.kv_pool=elastic")
    util = elastic["workload"]["utilization"]
    assert util > fixed["verdict"]["max_utilization"]          # no fragmentation share
    assert _requested(elastic)["kv_pool_bytes"] > _requested(fixed)["kv_pool_bytes"]
    resident_on = _plan("rollout.kv_pool=elastic", "memory.param_offload=false",
                        "memory.optimizer_offload=false")
    assert resident_on["workload"]["utilization"] < util       # the trainer's state stays
    assert any(line.startswith("elastic KV pool:") for line in summary_lines(elastic))
    assert not any(line.startswith("elastic KV pool:") for line in summary_lines(fixed))
