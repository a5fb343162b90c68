"""The elastic KV pool on a CUDA device (the driver's VMM through cuda-bindings): outputs equal
to a fixed pool's, 50 switches with no growth of driver-used memory and no graph recapture,
growth into memory freed while generating, less mapped when another owner took memory, and a
wake too full for one sequence refused before generating.

Run on the device: python3 -m pytest -q -m cuda tests/rollout/test_engine_elastic_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from handoff.errors import HandoffError
from handoff.rollout.engine import Engine
from handoff.rollout.sampling import SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
MiB = 1 << 20


def _tokens(outs):
    return [s.token_ids for o in outs for s in o.outputs]


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_elastic_equals_fixed_and_switches_without_growth(qwen3_dir, ref):
    fixed = Engine(str(qwen3_dir), ref.cfg(num_blocks=4096, block_size=16), dtype="bfloat16")
    expected = _tokens(fixed.generate(ref.mixed_prompts, GREEDY))
    fixed.sleep(2)
    engine = Engine(str(qwen3_dir), ref.cfg(kv_pool="elastic", block_size=16), dtype="bfloat16")
    assert engine.kv_mapped_bytes > 100 * engine.runner.kv_block_bytes() * 16
    assert _tokens(engine.generate(ref.mixed_prompts, GREEDY)) == expected
    captures = engine.stats()["graph_captures"]
    awake, asleep = [], []
    for _ in range(50):
        engine.sleep(1)
        asleep.append(_used())
        engine.wake_up()
        awake.append(_used())
    assert max(awake) - min(awake) < 64 * MiB, awake
    assert max(asleep) - min(asleep) < 64 * MiB, asleep
    assert min(awake) - max(asleep) > engine.kv_mapped_bytes - 64 * MiB  # really unmapped
    assert _tokens(engine.generate(ref.mixed_prompts, GREEDY)) == expected
    assert engine.stats()["graph_captures"] == captures
    engine.sleep(2)


def test_grows_into_memory_freed_while_generating(qwen3_dir, ref):
    # num_blocks=None: the pool's range is the whole card's (the fixture's default is 128)
    engine = Engine(str(qwen3_dir), ref.cfg(kv_pool="elastic", block_size=16, num_blocks=None,
                                            max_model_len=512), dtype="bfloat16")
    full = engine.kv_mapped_bytes
    engine.sleep(1)
    trainer = torch.empty(full // 2, dtype=torch.uint8, device="cuda")   # another owner
    engine.wake_up()
    start = engine.kv_mapped_bytes
    assert start < full - full // 4
    grown = []

    def between_steps():
        nonlocal trainer
        assert engine.blocks.tables.max() < engine.blocks.usable
        if len(grown) == 2 and trainer is not None:
            trainer = None
            torch.cuda.empty_cache()
            grown.append(engine.grow_kv())
        else:
            grown.append(engine.kv_mapped_bytes)

    outs = engine.generate(ref.mixed_prompts * 4, SamplingParams(temperature=0.0, max_tokens=48),
                           between_steps=between_steps)
    assert grown[0] == start and max(grown) > full - full // 8
    assert len(_tokens(outs)) == 4 * len(ref.mixed_prompts)
    engine.sleep(2)


def test_less_mapped_when_taken_and_refused_below_one_sequence(qwen3_dir, ref):
    engine = Engine(str(qwen3_dir), ref.cfg(kv_pool="elastic", block_size=16, num_blocks=None),
                    dtype="bfloat16")
    expected = _tokens(engine.generate(ref.mixed_prompts, GREEDY))
    full = engine.kv_mapped_bytes
    engine.sleep(1)
    other = torch.empty(full // 2, dtype=torch.uint8, device="cuda")
    with pytest.warns(UserWarning, match="less was free"):
        engine.wake_up()
    assert engine.kv_mapped_bytes < full
    assert _tokens(engine.generate(ref.mixed_prompts, GREEDY)) == expected
    engine.sleep(1)
    free = torch.cuda.mem_get_info()[0]
    hog = torch.empty(free - 64 * MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(HandoffError, match=r"cannot wake \[.*'kv_cache'\]"):
        engine.wake_up()
    del hog, other
    torch.cuda.empty_cache()
    engine.wake_up()
    assert _tokens(engine.generate(ref.mixed_prompts, GREEDY)) == expected
    engine.sleep(2)
