"""The elastic KV pool (rollout.kv_pool=elastic) on CPU over a simulated device: the same
greedy outputs and prefix hits as a fixed pool, a pool that grows while generating as memory
frees, the block manager never handing out an unmapped block, 50 sleep/wake switches
without growth, a wake that maps less when something else took memory, and one that cannot
hold a sequence failing before generating."""

import pytest

from handoff.errors import HandoffError
from handoff.memory.elastic import SimulatedDevice
from handoff.memory.regions import RegionPool
from handoff.rollout.engine import Engine
from handoff.rollout.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _tokens(outs):
    return [s.token_ids for o in outs for s in o.outputs]


def _engine(path, ref, sim=None, **cfg):
    pool = RegionPool("cpu", wake_margin_bytes=0)
    return Engine(str(path), ref.cfg(kv_pool="elastic", **cfg), simulated=sim, pool=pool)


def _sim(engine_blocks, path, ref, **cfg):
    """A simulated card of room for `engine_blocks` blocks of this model's pool."""
    probe = Engine(str(path), ref.cfg(**cfg))
    return SimulatedDevice(capacity=engine_blocks * probe.runner.kv_block_bytes(), granule=256)


def test_elastic_matches_fixed_outputs_and_prefix_cache(qwen3_dir, ref):
    fixed = Engine(str(qwen3_dir), ref.cfg())
    elastic = _engine(qwen3_dir, ref)
    prompts = ref.mixed_prompts + [list(range(10, 40)) + [5]]
    params = SamplingParams(temperature=0.0, n=2, max_tokens=20)
    assert _tokens(elastic.generate(prompts, params)) == _tokens(fixed.generate(prompts, params))
    hits = (fixed.stats()["prefix_cache_hits"], elastic.stats()["prefix_cache_hits"])
    assert hits[0] == hits[1] > 0
    assert elastic.stats()["kv_pool"] == "elastic"
    assert elastic.kv_mapped_bytes == elastic.stats()["kv_cache_bytes"]   # unlimited: all


def test_pool_grows_while_generating_and_never_hands_out_unmapped_blocks(llama_dir, ref):
    sim = _sim(80, llama_dir, ref, max_model_len=64)
    sim.others = sim.capacity // 2                   # the trainer still holds half the card
    engine = _engine(llama_dir, ref, sim, max_model_len=64, num_blocks=76)
    start = engine.blocks.usable
    assert 17 <= start < 76
    seen = []

    def between_steps():
        tables = engine.blocks.tables
        assert tables.max() < engine.blocks.usable, "a block past the mapped front was used"
        if engine.kv_short and sim.others:           # the pool holds generation back
            sim.others = 0                           # the trainer's copies landed
            engine.grow_kv()
            assert not engine.kv_short               # grown: short no longer
        seen.append(engine.blocks.usable)

    outs = engine.generate(ref.mixed_prompts * 2, SamplingParams(temperature=0.0, max_tokens=40),
                           between_steps=between_steps)
    assert seen[0] == start and max(seen) == 76      # grew to the whole reserved pool
    fixed = Engine(str(llama_dir), ref.cfg(max_model_len=64, num_blocks=76))
    again = fixed.generate(ref.mixed_prompts * 2, SamplingParams(temperature=0.0, max_tokens=40))
    assert _tokens(outs) == _tokens(again)


def test_fifty_switches_same_outputs_no_growth(qwen3_dir, ref):
    sim = _sim(200, qwen3_dir, ref)
    engine = _engine(qwen3_dir, ref, sim)
    first = _tokens(engine.generate(ref.mixed_prompts, GREEDY))
    mapped = engine.kv_mapped_bytes
    for _ in range(50):
        engine.sleep(1)
        assert engine.kv_mapped_bytes == 0 and sim.capacity - engine.kv_arena.free_bytes() == 0
        engine.wake_up()
        assert engine.kv_mapped_bytes == mapped
    assert _tokens(engine.generate(ref.mixed_prompts, GREEDY)) == first


def test_wake_maps_less_when_memory_was_taken_and_refuses_below_one_sequence(qwen3_dir, ref):
    sim = _sim(200, qwen3_dir, ref)
    engine = _engine(qwen3_dir, ref, sim)
    first = _tokens(engine.generate(ref.mixed_prompts, GREEDY))
    full = engine.kv_mapped_bytes
    engine.sleep(1)
    sim.others = sim.capacity // 2
    with pytest.warns(UserWarning, match="mapped .* blocks at this wake, .* at the last"):
        engine.wake_up()
    assert 0 < engine.kv_mapped_bytes < full and engine.blocks.usable < engine.blocks.num_blocks
    assert _tokens(engine.generate(ref.mixed_prompts, GREEDY)) == first
    engine.sleep(1)
    sim.others = sim.capacity - 4 * engine.runner.kv_block_bytes()
    with pytest.raises(HandoffError, match=r"cannot wake \['kv_cache'\]"):
        engine.wake_up()
    with pytest.raises(HandoffError, match="asleep"):
        engine.generate(ref.mixed_prompts, GREEDY)


def test_elastic_refuses_tensor_parallel_and_names_the_fix(qwen3_dir, ref, monkeypatch):
    from handoff.rollout import engine as engine_module

    class TwoRanks:
        size, rank = 2, 0

    monkeypatch.setattr(engine_module, "init_tp_group", lambda tp: TwoRanks())
    with pytest.raises(HandoffError, match="kv_pool=fixed with parallel.tp > 1"):
        _engine(qwen3_dir, ref)
