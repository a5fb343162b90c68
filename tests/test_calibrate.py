"""The rates a run measures for its ledger (handoff.calibrate): links, remaps (map / unmap),
the sync's copies and its host work per tensor; and a run that measures them at its start."""

import json

import pytest
import torch

from handoff.calibrate import (measure_link_rates, measure_remap_rates, measure_sync_copy_bps,
                               measure_tensor_host_seconds)
from handoff.config import load_config
from handoff.loop import Run
from handoff.memory.regions import RegionPool
from handoff.modelzoo import init_model
from handoff.runplan import RunPlan


def test_remap_rates_on_cpu_are_positive_and_leave_the_region_asleep():
    pool = RegionPool("cpu")
    nbytes = 8 << 20
    rates = measure_remap_rates(torch.device("cpu"), nbytes, pool=pool)
    assert rates["remap_bytes"] == nbytes
    assert rates["map_bps"] > 0 and rates["unmap_bps"] > 0
    # Asleep: the pool holds the region's bytes as a sleeping region, no memory behind it.
    assert pool.tags == ["calibrate"] and not pool.is_awake("calibrate")
    assert pool.region_bytes("calibrate") == nbytes


@pytest.mark.parametrize("slabs", [1, 6])
def test_remap_rates_of_an_elastic_pool_are_measured_on_an_arena_of_its_slabs(slabs,
                                                                             monkeypatch):
    """rollout.kv_pool=elastic maps one driver allocation per layer's K or V: the sleep
    unmaps them all, the wake maps them all, each timed pair once per repeat."""
    from handoff.memory.elastic import ElasticArena

    calls = []
    real_grow, real_release = ElasticArena.grow_to, ElasticArena.release
    monkeypatch.setattr(ElasticArena, "grow_to", lambda self, per_slab: calls.append(
        ("map", self.slabs, real_grow(self, per_slab))))   # what it mapped, per slab
    monkeypatch.setattr(ElasticArena, "release", lambda self: calls.append(
        ("unmap", self.slabs, self.mapped_per_slab)) or real_release(self))
    pool = RegionPool("cpu")
    nbytes = (3 << 20) + 5   # not a whole number of granules a slab
    rates = measure_remap_rates(torch.device("cpu"), nbytes, pool=pool, repeats=2, slabs=slabs)
    granule = ElasticArena.granule_bytes("cpu")
    slab = -(-nbytes // slabs // granule) * granule
    assert rates["remap_bytes"] == slabs * slab >= nbytes
    assert rates["map_bps"] > 0 and rates["unmap_bps"] > 0
    # Mapped whole at creation; then warm-up + 2 timed pairs, each a whole unmap and map;
    # left asleep (the last unmap).
    assert calls == [("map", slabs, slab)] + [("unmap", slabs, slab), ("map", slabs, slab)] * 3 \
        + [("unmap", slabs, slab)]
    assert pool.is_elastic("calibrate") and not pool.is_awake("calibrate")


@pytest.mark.parametrize("kv_pool", ["fixed", "elastic"])
def test_a_run_measures_its_pools_remaps_on_the_pools_own_kind(kv_pool, model_dir, tmp_path,
                                                               monkeypatch):
    import handoff.calibrate as calibrate_module

    seen = []
    real = calibrate_module.measure_remap_rates

    def spy(device, nbytes, **kw):
        seen.append((kw.get("tag", "calibrate"), kw.get("slabs", 0)))
        return real(device, nbytes, **kw)

    monkeypatch.setattr(calibrate_module, "measure_remap_rates", spy)
    run = Run(_cfg(model_dir, tmp_path, f"rollout.kv_pool={kv_pool}"))
    slabs = 2 * run.plan.shape.num_layers if kv_pool == "elastic" else 0
    # The KV pool's, then the weights' (one allocation, as the engine holds them).
    assert seen == [("calibrate", slabs), ("calibrate_weights", 0)]


def test_remap_rates_without_a_pool_build_their_own():
    rates = measure_remap_rates(torch.device("cpu"), 1 << 20, repeats=1, tag="other")
    assert rates["remap_bytes"] == 1 << 20 and rates["map_bps"] > 0


def test_a_wake_is_measured_with_memory_held_and_just_freed(monkeypatch):
    """The KV wake of a switch follows the trainer handing memory back while the engine's
    weights are mapped: each timed wake sees the held block alive and the freed one gone."""
    import weakref

    from handoff import calibrate

    made, seen = [], []
    real_touched = calibrate._touched

    def touched(nbytes, device):
        t = real_touched(nbytes, device)
        made.append((nbytes, weakref.ref(t)))
        return t

    monkeypatch.setattr(calibrate, "_touched", touched)
    pool = RegionPool("cpu")
    real_wake = pool.wake_up

    def wake_up(tags=None):
        seen.append([(n, ref() is not None) for n, ref in made[-3:]])
        real_wake(tags)

    monkeypatch.setattr(pool, "wake_up", wake_up)
    measure_remap_rates(torch.device("cpu"), 1 << 20, pool=pool, repeats=2,
                        held_during_wake=3 << 20, freed_before_wake=[(2 << 20, 0.0),
                                                                     (5 << 20, 0.01)])
    # Per wake (warm-up + 2 timed): held alive; both freed, the earlier one allocated first.
    assert seen == [[(3 << 20, True), (5 << 20, False), (2 << 20, False)]] * 3
    assert all(ref() is None for _, ref in made)  # nothing outlives the measurement


def test_tensor_host_seconds_is_a_host_cost_per_tensor():
    per_tensor = measure_tensor_host_seconds(torch.device("cpu"), tensors=64)
    # Three tiny copies and a few views: microseconds, not nothing and not milliseconds.
    assert 1e-7 < per_tensor < 1e-3


def _weights(device, sizes=(4096, 256, 65536, 256, 4096, 65536, 256, 4096)):
    made = [(f"w{i}", torch.randn(n, device=device)) for i, n in enumerate(sizes)]
    return lambda: iter(made), [4 * n for n in sizes]


def test_sync_copy_rate_runs_the_sync_over_a_sample_that_keeps_the_mix():
    params, nbytes = _weights(torch.device("cpu"))
    whole = measure_sync_copy_bps(torch.device("cpu"), params, bucket_bytes=1 << 20)
    assert whole["sync_sample_bytes"] == sum(nbytes)
    assert whole["sync_copy_bps"] > 0
    # A budget of a quarter takes every 4th tensor, not the first quarter's bytes.
    quarter = measure_sync_copy_bps(torch.device("cpu"), params, bucket_bytes=1 << 20,
                                    budget_bytes=sum(nbytes) // 4)
    assert quarter["sync_sample_bytes"] == sum(nbytes[::4])
    assert measure_sync_copy_bps(torch.device("cpu"), params, bucket_bytes=1 << 20,
                                 budget_bytes=0) == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sync_copy_rate_on_cuda_is_of_the_order_of_one_large_copy():
    """On the device: a kernel per tensor runs at the order of one large copy's rate (the
    4B's measured 2.15 against 3.9 TB/s); the scratch destinations go back."""
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = [2560 * 9728, 2560, 2560 * 4096, 128] * 24   # MLP, norm, attention, q_norm
    params, _ = _weights(device, sizes)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    rate = measure_sync_copy_bps(device, params, bucket_bytes=512 << 20)["sync_copy_bps"]
    assert torch.cuda.memory_allocated(device) == before
    d2d = measure_link_rates(device)["d2d_bps"]
    assert 0.1 * d2d < rate < 1.2 * d2d


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("slabs", [0, 16])
def test_remap_rates_on_cuda_give_the_memory_back(slabs):
    """On the device: both rates positive, the region left asleep, its pages back to the
    driver; one torch_memory_saver allocation or an elastic arena's slabs."""
    from handoff.memory.allocator import aggressive_empty_cache

    aggressive_empty_cache()
    device = torch.device("cuda", torch.cuda.current_device())
    free_before = torch.cuda.mem_get_info(device)[0]
    pool = RegionPool(device)
    rates = measure_remap_rates(device, 4 << 30, pool=pool, slabs=slabs)
    assert rates["remap_bytes"] >= 4 << 30
    assert rates["map_bps"] > 1e9 and rates["unmap_bps"] > 1e9
    assert not pool.is_awake("calibrate")
    assert torch.cuda.mem_get_info(device)[0] > free_before - (256 << 20)  # metadata
    assert measure_tensor_host_seconds(device) < 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_h2d_and_launches_behind_queued_copies_are_measured():
    """On the device: the kernel-driven H2D runs at the link's order of rate; host work per
    tensor is no cheaper with 8 GiB of D2H queued than without."""
    device = torch.device("cuda", torch.cuda.current_device())
    rates = measure_link_rates(device)
    assert 0.5 * rates["h2d_bps"] < rates["h2d_kernel_bps"] < 2 * rates["h2d_bps"]
    idle = measure_tensor_host_seconds(device)
    queued = measure_tensor_host_seconds(device, d2h_in_flight_bytes=8 << 30)
    assert queued > 0.8 * idle


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("calib-model"), dtype="float32")


def _cfg(model, out_dir, *extra):
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                   f"run.out_dir={out_dir}", *extra])


def test_a_run_measures_its_start_rates_and_times_its_saves(model_dir, tmp_path):
    trainer = Run(_cfg(model_dir, tmp_path, "run.steps=2"))
    rates = trainer.rates.values
    # Calibrated at the size the KV wake maps: the pool the engine then took.
    assert rates["remap_bytes"] == trainer.worker.engine.stats()["kv_cache_bytes"]
    assert rates["map_bps"] > 0 and rates["unmap_bps"] > 0
    # ... and at the size of the weights the sync wakes (the engine pads its flat buffer;
    # the RoPE table shares their region).
    engine = trainer.worker.engine
    assert rates["weights_remap_bytes"] == pytest.approx(
        engine.pool.region_bytes("weights") - engine.model.rope_cos_sin.nbytes, rel=0.01)
    assert rates["weights_map_bps"] > 0
    saved = trainer.step(0, save=True)
    assert saved["timing_s/checkpoint"] > 0
    assert saved["timing_s/checkpoint"] < saved["timing_s/step"]
    # The prompts' sampling and their scoring are host work of the step's own, inside it.
    assert 0 < saved["timing_s/host"] < saved["timing_s/step"] - saved["timing_s/gen"]
    assert trainer.step(1)["timing_s/checkpoint"] == 0.0
    trainer.report.start(0)
    trainer.report.log_step(saved)
    summary = trainer.report.finish()
    for key in ("map_bps", "unmap_bps", "remap_bytes", "weights_map_bps", "tensor_host_s",
                "sync_copy_bps", "sync_sample_bytes"):
        assert summary["rates"][key] > 0
    assert "unmap" in (tmp_path / "summary.md").read_text()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["timing_s/checkpoint"] == saved["timing_s/checkpoint"]


def test_decode_rates_leave_the_engine_as_it_was(model_dir):
    from handoff.calibrate import measure_decode_rates
    from handoff.config import RolloutConfig
    from handoff.rollout.engine import Engine

    from handoff.rollout.sampling import SamplingParams

    cfg = RolloutConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8)
    engine, fresh = Engine(str(model_dir), cfg), Engine(str(model_dir), cfg)
    rates = measure_decode_rates(engine, batch=8, steps=4)
    assert rates["decode_floor_s"] > 0 and rates["decode_per_seq_s"] >= 0
    assert engine.blocks.num_free_blocks == 63 and engine.blocks.num_cached_free_blocks == 0
    seeded = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=7)
    tokens = [[s.token_ids for s in o.outputs] for e in (engine, fresh)
              for o in e.generate([[1] * 16 + [5]], seeded)]
    assert tokens[0] == tokens[1]   # no cached prefix of the measurement changes a sample


def test_the_measured_wake_leaves_the_margin_beside_the_held_weights(model_dir, tmp_path,
                                                                      monkeypatch):
    import handoff.calibrate as calibrate_module

    cfg = _cfg(model_dir, tmp_path)
    margin = 8 << 30
    pool = RegionPool(torch.device("cpu"), wake_margin_bytes=margin)
    kv, weights, _ = calibrate_module._switch_sizes(cfg, RunPlan.build(cfg), pool)   # this host: room for all
    # A card with room for the weights and half the pool beside the margin: the KV region
    # measured is what the wake can map while the weights are held (a large
    # memory.wake_margin_mb failed at start-up on the device before).
    free = margin + (1 << 30) + weights + kv // 2
    monkeypatch.setattr(calibrate_module, "host_memory", lambda: (0, free))
    small_kv, small_weights, _ = calibrate_module._switch_sizes(cfg, RunPlan.build(cfg), pool)
    assert small_weights == weights and small_kv <= kv // 2
    assert small_kv + small_weights + margin <= free


@pytest.mark.parametrize("lora", [[], ["actor.lora.rank=4"]])
def test_an_elastic_pool_is_measured_at_what_its_wake_maps(lora, model_dir, tmp_path,
                                                           monkeypatch):
    """On a card an elastic wake maps every free byte less the engine's overhead (activation
    peak, graph pool) and the margin, not gpu_memory_utilization's share as a fixed pool
    takes: the calibration's region is the size the run will map (a larger unmap is slower
    a byte)."""
    import types

    import handoff.calibrate as calibrate_module

    gib = 1 << 30
    free, total = 60 * gib, 80 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    card = types.SimpleNamespace(device=torch.device("cuda", 0), wake_margin_bytes=gib)
    sizes = {}
    for kv_pool in ("fixed", "elastic"):
        cfg = _cfg(model_dir, tmp_path, f"rollout.kv_pool={kv_pool}",
                   "rollout.gpu_memory_utilization=0.3", "rollout.num_blocks=null", *lora)
        plan = RunPlan.build(cfg)
        sizes[kv_pool] = calibrate_module._switch_sizes(cfg, plan, card)
    hw = plan.hardware
    overhead = hw.activation_peak_bytes + hw.graph_pool_bytes
    kv, weights, _ = sizes["elastic"]
    room = free - gib - gib - overhead - weights   # the margin, the slack, the engine's own
    assert room - 64 * 1024 <= kv <= room   # whole blocks
    assert sizes["fixed"][0] <= 0.3 * total < kv


def test_lora_on_a_shared_base_measures_the_kv_wake_beside_the_weights_it_holds(
        model_dir, tmp_path, monkeypatch):
    import handoff.calibrate as calibrate_module

    cfg = _cfg(model_dir, tmp_path, "actor.lora.rank=4")
    plan = RunPlan.build(cfg)
    assert cfg.actor.lora.shares_base and plan.order.mode == "lora"
    margin = 1 << 30
    pool = RegionPool(torch.device("cpu"), wake_margin_bytes=margin)
    kv, weights, freed = calibrate_module._switch_sizes(cfg, plan, pool)
    # The engine's weights are the trainer's base, mapped already (free memory excludes them):
    # nothing of their size is held beside the wake again or mapped on its own, and no
    # full-parameter optimizer or bucket is freed before it.
    assert weights == 0 and freed == []
    free = margin + (1 << 30) + kv // 2
    monkeypatch.setattr(calibrate_module, "host_memory", lambda: (0, free))
    small_kv, _, _ = calibrate_module._switch_sizes(cfg, plan, pool)
    assert small_kv == kv // 2   # all the room is the KV's: no weights subtracted again


@pytest.mark.parametrize("param_offload", [False, True])
def test_lora_with_the_base_held_twice_replays_the_runs_own_frees_not_a_full_models(
        model_dir, tmp_path, param_offload):
    """A map right after large frees is slower: the wake is measured after what this run
    hands back (the adapters' Adam state; offloaded, the trainer's base and adapters), the
    bytes the run's own actor holds, not a full model's optimizer."""
    import handoff.calibrate as calibrate_module

    cfg = _cfg(model_dir, tmp_path, "actor.lora.rank=4", "actor.lora.share_base=false",
               f"memory.param_offload={str(param_offload).lower()}")
    run = Run(cfg)
    parts = run.worker.actor.memory_parts()   # what the built actor holds, per owner
    _, weights, freed = calibrate_module._switch_sizes(cfg, run.plan,
                                                      RegionPool(torch.device("cpu")))
    buckets = 2 * (cfg.sync.bucket_mb << 20)
    params = parts["params"] if param_offload else 0
    assert weights > 0   # the engine's own copy, held beside the wake
    lead = pytest.approx(params / run.plan.hardware.pinned_pcie_bps)
    assert freed == [(params + buckets, 0.0), (parts["optimizer"], lead)]
    full = calibrate_module.trainer_bytes(run.plan.shape, run.plan.shard, run.plan.dtypes,
                                          ref=False)
    assert parts["optimizer"] < full["optimizer"] / 10


def test_a_shared_base_maps_its_kv_beside_the_base_with_nothing_replayed(model_dir, tmp_path):
    """On a shared LoRA base the weights are mapped already (the trainer's base), and the
    activations handed back before the wake are not replayed: a replay changed the map's
    rate by 10x either way with its size (scripts/device/calib_probe.py)."""
    import handoff.calibrate as calibrate_module

    pool = RegionPool(torch.device("cpu"))
    shared = _cfg(model_dir, tmp_path, "actor.lora.rank=4", "actor.lora.share_base=true")
    kv, weights, freed = calibrate_module._switch_sizes(shared, RunPlan.build(shared), pool)
    assert kv > 0 and weights == 0 and freed == []
    twice = _cfg(model_dir, tmp_path, "actor.lora.rank=4", "actor.lora.share_base=false")
    _, weights, freed = calibrate_module._switch_sizes(twice, RunPlan.build(twice), pool)
    assert weights > 0 and freed   # the engine's own copy, and the adapters' Adam state


def test_the_adapter_sync_is_timed_over_a_steps_loads_not_the_first(model_dir, tmp_path):
    """The first load of a layout zeroes the engine's buffers, a step's does not: the price
    per tensor is the median of the loads after the first, and the engine holds the
    actor's adapters after it."""
    import handoff.calibrate as calibrate_module

    cfg = _cfg(model_dir, tmp_path, "actor.lora.rank=4")
    run = Run(cfg)
    actor, engine = run.worker.actor, run.worker.engine
    loads = []
    real = engine.lora.load
    engine.lora.load = lambda *a, **kw: loads.append(1) or real(*a, **kw)
    per_tensor = calibrate_module.measure_adapter_tensor_seconds(
        actor, engine, repeats=3, d2h_in_flight_bytes=1 << 20)
    assert per_tensor > 0 and len(loads) == 1 + 3
    name, a = next(t for t in actor.adapter_tensors(engine.dtype) if ".q_proj.lora_A" in t[0])
    layer = int(name.split(".layers.")[1].split(".")[0])
    slot = engine.lora.linears[f"model.layers.{layer}.self_attn.qkv_proj"].lora
    torch.testing.assert_close(slot.A[:a.shape[0]],
                               a * (cfg.actor.lora.alpha / cfg.actor.lora.rank))


@pytest.mark.parametrize("copies_outlast_a_call", [True, False])
def test_every_timed_call_starts_with_the_copies_in_flight(copies_outlast_a_call):
    """The sync's price beside the optimizer's copy-out: copies queued before the first timed
    call, and queued again before any call that would find them done (a load longer than
    the copies, the 14B's adapters, ran beside them only the first time)."""
    from handoff import calibrate

    events = []
    calibrate._timed_while(lambda: events.append("call"), 3,
                           start_beside=lambda: events.append("copies"),
                           beside_done=lambda: not copies_outlast_a_call,
                           wait=lambda: events.append("wait"))
    if copies_outlast_a_call:
        assert events == ["copies"] + ["call", "wait"] * 3
    else:
        assert events == ["copies", "call", "wait"] * 3


@pytest.mark.parametrize("overrides, beside", [
    ([], False),                                    # streamed, elastic: the copy starts after
    (["memory.overlap=false"], True),               # in turn: started before the sync
    (["rollout.kv_pool=fixed"], True),              # a fixed pool: the same
    (["memory.optimizer_offload=false"], False),    # nothing to copy
    (["actor.lora.rank=4"], False),                 # LoRA's order, streamed
    (["actor.lora.rank=4", "memory.overlap=false"], True),
    (["actor.lora.rank=4", "actor.lora.share_base=false"], False),   # held twice: the
    (["actor.lora.rank=4", "actor.lora.share_base=false", "rollout.kv_pool=fixed"], True),  # full order
])
def test_the_sync_is_timed_beside_the_optimizers_copy_only_where_the_order_starts_it_first(
        tmp_path, overrides, beside):
    from handoff.calibrate import optimizer_d2h_bytes

    class Actor:   # the optimizer's bytes are all the function reads of an actor
        def memory_parts(self):
            return {"params": 10, "grads": 10, "optimizer": 123}

    cfg = load_config("examples/cpu-tiny.yaml", ["model.path=tiny-qwen3", "rollout.kv_pool=elastic",
                                                 "memory.optimizer_offload=true",
                                                 f"run.out_dir={tmp_path}", *overrides])
    order = RunPlan.build(cfg).order
    move = order.get("optimizer_d2h")
    assert optimizer_d2h_bytes(order, Actor()) == (123 if beside else 0)
    if move is not None:   # where it is 0 with an offload, the copy is queued after the sync
        actions = [m.action for m in order.moves]
        assert (actions.index("optimizer_d2h") < actions.index("engine_weights_sync")) == beside
