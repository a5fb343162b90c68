"""The KV pool's one sizing rule (rollout/kv_sizing.py), which the engine applies at start
and the calibration beforehand."""

from handoff.config import RolloutConfig
from handoff.rollout.kv_sizing import blocks_for_one_sequence, kv_pool_blocks

GiB = 1 << 30


def test_cuda_takes_its_utilization_share_and_an_elastic_pool_all_the_card_could_hold():
    cfg = RolloutConfig(gpu_memory_utilization=0.5)
    kw = dict(block_bytes=GiB // 4, on_cuda=True, max_model_len=4096, hbm_bytes=80 * GiB,
              weights_bytes=8 * GiB, overhead_bytes=2 * GiB)
    assert kv_pool_blocks(cfg, **kw) == (40 - 8 - 2) * 4
    assert kv_pool_blocks(cfg, **kw, elastic=True) == (80 - 8 - 2) * 4
    assert kv_pool_blocks(cfg, **{**kw, "weights_bytes": 90 * GiB}, elastic=True) == 0


def test_set_blocks_win_and_the_cpu_pool_ignores_the_card():
    assert kv_pool_blocks(RolloutConfig(num_blocks=77), block_bytes=1024, on_cuda=True,
                          max_model_len=64, hbm_bytes=80 * GiB, elastic=True) == 77
    cfg = RolloutConfig(max_num_seqs=2, max_model_len=64, block_size=16)
    plain = kv_pool_blocks(cfg, block_bytes=1024, on_cuda=False, max_model_len=64)
    assert plain == kv_pool_blocks(cfg, block_bytes=1024, on_cuda=False, max_model_len=64,
                                   elastic=True)
    assert plain == 2 * (blocks_for_one_sequence(64, 16) - 1) + 1
