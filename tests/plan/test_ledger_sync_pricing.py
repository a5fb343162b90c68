"""The ledger's remaps and weight sync: map vs unmap rates, in-process vs gathered sync."""

from dataclasses import replace

import pytest

from handoff.config import HardwareConfig, MemoryConfig, ParallelConfig
from handoff.plan.hardware import GB, hardware_profile
from handoff.plan.kvpool import engine_weight_bytes
from handoff.plan.ledger import Dtypes, switch_actions, trainer_bytes, weight_sync_seconds
from handoff.plan.shapes import PRESETS, count_tensors, load_shape

H200 = hardware_profile("h200")
D = Dtypes()
BUCKET = 512 << 20


def _acts(shape, hw, parallel=ParallelConfig(gpus=1), pool=100 * GB, memory=None, **kw):
    memory = memory or MemoryConfig(overlap=False)
    return {a.name: a for a in switch_actions(shape, parallel, memory, hw,
                                              kv_pool_bytes=pool, **kw)}


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "qwen3-8b", "llama3-8b",
                                  "qwen2.5-7b"])
def test_tensor_count_is_what_transformers_builds(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = dict(PRESETS[name])
    small = {"num_hidden_layers": 2, "vocab_size": 300, "hidden_size": 64,
             "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "bos_token_id": 0, "eos_token_id": 1}
    if "head_dim" in fields:
        small["head_dim"] = 16
    fields.update(small)
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert count_tensors({**fields, "model_type": model_type}) == len(list(model.parameters()))


def test_qwen3_1p7b_sends_310_tensors():
    # 28 layers x (q, k, v, o, q_norm, k_norm, gate, up, down, 2 norms) + embed + final norm,
    # the LM head tied: the count the device's sync reported.
    assert load_shape("qwen3-1.7b").num_tensors == 310


def test_kv_wake_maps_and_sleep_unmaps_at_their_own_rates():
    shape = load_shape("qwen3-4b")
    pool = 116e9
    base = _acts(shape, H200, pool=pool)
    weights = engine_weight_bytes(shape, 1)
    assert base["kv_cache_wake"].seconds == pytest.approx(pool / H200.map_bps)
    assert base["engine_sleep"].seconds == pytest.approx((weights + pool) / H200.unmap_bps)
    slow_map = _acts(shape, replace(H200, map_bps=H200.map_bps / 4), pool=pool)
    assert slow_map["kv_cache_wake"].seconds == pytest.approx(4 * base["kv_cache_wake"].seconds)
    assert slow_map["engine_sleep"].seconds == base["engine_sleep"].seconds
    fp8 = _acts(shape, H200, pool=pool, dtypes=Dtypes(kv_bytes=1))
    assert fp8["kv_cache_wake"].seconds == pytest.approx(pool / H200.map_bps + pool / H200.d2d_bps)


def test_in_process_sync_maps_then_overlaps_host_work_and_copies():
    shape = load_shape("qwen3-4b")
    one = ParallelConfig(gpus=1)
    full = shape.num_params * 2
    in_proc = weight_sync_seconds(shape, one, H200, D, BUCKET)
    copies = 2 * (full + full) / H200.sync_copy_bps   # into the bucket and out of it
    host = shape.num_tensors * H200.sync_tensor_seconds
    assert copies > host   # an H200 with a 4B model: the device sets the pace
    assert in_proc == pytest.approx(full / H200.map_bps + copies)
    # No IPC: the per-bucket overhead does not appear.
    no_buckets = replace(H200, sync_bucket_seconds=1.0)
    assert weight_sync_seconds(shape, one, no_buckets, D, BUCKET) == pytest.approx(in_proc)
    # A slower host hides behind the copies until it is the slower side.
    hidden = replace(H200, sync_tensor_seconds=0.9 * copies / shape.num_tensors)
    assert weight_sync_seconds(shape, one, hidden, D, BUCKET) == pytest.approx(in_proc)
    slow_host = replace(H200, sync_tensor_seconds=2 * copies / shape.num_tensors)
    assert weight_sync_seconds(shape, one, slow_host, D, BUCKET) == pytest.approx(
        in_proc + copies)
    slow_copies = replace(H200, sync_copy_bps=H200.sync_copy_bps / 2)
    assert weight_sync_seconds(shape, one, slow_copies, D, BUCKET) == pytest.approx(
        in_proc + copies)
    # Mapping is not linear in size: a rate measured at the weights' size replaces map_bps.
    fast = weight_sync_seconds(shape, one, H200, D, BUCKET, weights_map_bps=10 * H200.map_bps)
    assert fast == pytest.approx(in_proc - 0.9 * full / H200.map_bps)
    # The same card through the source's CUDA IPC path pays per bucket instead.
    ipc = weight_sync_seconds(shape, one, H200, D, BUCKET, in_process=False)
    assert ipc == pytest.approx(2 * 2 * full / H200.d2d_bps
                                + -(-full // BUCKET) * H200.sync_bucket_seconds)
    assert _acts(shape, H200)["engine_weights_sync"].link == "in-card copy"


def test_gathered_sync_is_the_ipc_path_unless_told_in_process():
    shape = load_shape("qwen3-32b")
    eight = ParallelConfig(gpus=8, tp=8)
    full = shape.num_params * 2
    gather = full * 7 / 8 / H200.nvlink_bps
    written = engine_weight_bytes(shape, 8)
    ipc = weight_sync_seconds(shape, eight, H200, D, BUCKET)
    assert ipc == pytest.approx(gather + 2 * (full + written) / H200.d2d_bps
                                + -(-full // BUCKET) * H200.sync_bucket_seconds)
    local = weight_sync_seconds(shape, eight, H200, D, BUCKET, in_process=True)
    assert local == pytest.approx(gather + written / H200.map_bps
                                  + max(2 * (full + written) / H200.sync_copy_bps,
                                        shape.num_tensors * H200.sync_tensor_seconds))
    links = {p: _acts(shape, H200, eight, in_process=p)["engine_weights_sync"].link
             for p in (None, True)}
    assert links == {None: "NVLink all-gather + CUDA IPC",
                     True: "NVLink all-gather + in-process copy"}


def test_config_overrides_the_remap_and_sync_rates():
    hw = hardware_profile("h200", HardwareConfig(map_gbps=100, unmap_gbps=200,
                                                 sync_tensor_us=25, sync_copy_gbps=900))
    assert (hw.map_bps, hw.unmap_bps) == (100 * GB, 200 * GB)
    assert hw.sync_tensor_seconds == pytest.approx(25e-6)
    assert hw.sync_copy_bps == 900 * GB


def test_copies_right_after_the_sleep_are_priced_at_the_kernel_rate():
    shape = load_shape("qwen3-4b")
    hw = replace(H200, kernel_h2d_bps=50 * GB)
    acts = _acts(shape, hw, h2d_bps=55 * GB)
    # The params and the ref come back by kernel (the copy engines are busy then).
    for name in ("params_h2d", "ref_h2d"):
        assert acts[name].seconds == pytest.approx(acts[name].bytes_per_card / (50 * GB))
    # The optimizer comes in long after (before the update), on the copy engines.
    assert acts["optimizer_h2d"].seconds == pytest.approx(
        acts["optimizer_h2d"].bytes_per_card / (55 * GB))
    assert acts["params_d2h"].seconds == pytest.approx(
        acts["params_d2h"].bytes_per_card / H200.pinned_pcie_bps)
    # Streamed with a ref, the params come back on the copy engines under the ref's forward.
    streamed = _acts(shape, hw, h2d_bps=55 * GB, memory=MemoryConfig(overlap=True))
    assert streamed["params_h2d"].seconds == pytest.approx(
        streamed["params_h2d"].bytes_per_card / (55 * GB))
    assert streamed["ref_h2d"].seconds == acts["ref_h2d"].seconds
    no_ref = _acts(shape, hw, h2d_bps=55 * GB, memory=MemoryConfig(overlap=True), ref=False)
    assert no_ref["params_h2d"].seconds == acts["params_h2d"].seconds
    # Old log-probs first (more than one update a step): the actor's forward needs them
    # before the ref's runs, so they come back by kernel.
    two = _acts(shape, hw, h2d_bps=55 * GB, memory=MemoryConfig(overlap=True), updates_per_step=2)
    assert two["params_h2d"].seconds == acts["params_h2d"].seconds
    # A card whose kernel rate is not known: every move at the link's rate.
    plain = _acts(shape, replace(H200, kernel_h2d_bps=0.0))
    assert plain["params_h2d"].seconds == pytest.approx(
        plain["params_h2d"].bytes_per_card / H200.pinned_pcie_bps)


def test_an_elastic_wake_beside_the_copies_maps_the_pool_less_the_state_in_flight():
    shape = load_shape("qwen3-4b")
    owners = trainer_bytes(shape, 1, Dtypes())
    pool = 140 * GB
    fixed = _acts(shape, H200, pool=pool, memory=MemoryConfig(overlap=True))
    streamed = _acts(shape, H200, pool=pool, memory=MemoryConfig(overlap=True),
                     elastic_pool=True)
    in_flight = owners["optimizer"] + owners["params"]
    assert fixed["kv_cache_wake"].bytes_per_card == pool
    assert streamed["kv_cache_wake"].bytes_per_card == pool - in_flight
    assert streamed["kv_cache_wake"].seconds < fixed["kv_cache_wake"].seconds
    assert "beside the copies" in streamed["kv_cache_wake"].note
    # In turn, the copies land first and the wake maps the whole pool.
    in_turn = _acts(shape, H200, pool=pool, memory=MemoryConfig(overlap=False),
                    elastic_pool=True)
    assert in_turn["kv_cache_wake"].bytes_per_card == pool
    # Only what is offloaded is in flight.
    kept = _acts(shape, H200, pool=pool, elastic_pool=True,
                 memory=MemoryConfig(overlap=True, optimizer_offload=False))
    assert kept["kv_cache_wake"].bytes_per_card == pool - owners["params"]
