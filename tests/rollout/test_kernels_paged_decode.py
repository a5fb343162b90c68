"""Tests of the Triton paged decode kernel (handoff.rollout.kernels.paged_decode).

CPU: the kernel itself runs under TRITON_INTERPRET=1 in ONE subprocess (the variable must be set
before Triton decorates the kernels, and other test modules import Triton normally); there the
inputs are fp16 because the interpreter's tl.dot mishandles bf16. CUDA (`-m cuda`): bf16 and fp8
across block sizes, GQA ratios, batch sizes and context lengths against a float32 reference and
FlexAttention, plus a CUDA-graph replay with new lengths. Every check draws fresh inputs,
poisons the output and the unused cache slots with NaN, and compares by ||out-ref|| / ||ref||.
The random caches, the float32 reference and the FlexAttention oracle live in
paged_attention_oracles.py beside this file.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from paged_attention_oracles import check, flex_paged_decode, make_case, reference, run_kernel
from triton_interpreter import fix_interpreter_loop_bounds, results_under_interpreter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# name: (batch, kv heads, group, head_dim, block_size, context lens, kwargs of the call, fp8)
INTERP_CASES = {
    "gqa4_bs16_multi_tile": (3, 2, 4, 32, 16, [1, 17, 50], {"num_splits": 1}, False),
    "split3_with_empty_row": (3, 1, 2, 32, 16, [0, 45, 33], {"num_splits": 3}, False),
    "block24_not_pow2_gqa8": (2, 1, 8, 16, 24, [70, 5], {"num_splits": 2}, False),
    "block64_larger_than_tile": (2, 2, 1, 32, 64, [100, 64], {"config": {"tile": 32}}, False),
    "head_dim24_padded": (1, 2, 2, 24, 16, [20], {"num_splits": 2}, False),
    "fp8_scales_split": (2, 2, 4, 32, 16, [30, 47], {"num_splits": 2}, True),
    # rows' programs started longest first (the engine's order); a wrong row mapping mixes rows
    "longest_first": (3, 2, 4, 32, 16, [1, 17, 50], {"num_splits": 1, "order": [2, 1, 0]}, False),
    "longest_first_split_empty_row": (3, 1, 2, 32, 16, [0, 45, 33],
                                      {"num_splits": 3, "order": [1, 2, 0]}, False),
}


def _interpreter_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    fix_interpreter_loop_bounds()
    results = {}
    for i, (name, (B, K, G, D, bs, ctx, kw, fp8)) in enumerate(INTERP_CASES.items()):
        kw = {"config": {"tile": 16}, **kw}
        if "order" in kw:
            kw["order"] = torch.tensor(kw["order"], dtype=torch.int32)
        case = make_case(100 + i, B, K, G, D, bs, ctx, torch.float16, "cpu", fp8=fp8)
        results[name] = check(case, run_kernel(case, **kw))
    # Row slots follow `order`: with row 1 left out of it, row 1 keeps its NaN poison.
    case = make_case(200, 3, 2, 4, 32, 16, [1, 17, 50], torch.float16, "cpu")
    out = run_kernel(case, config={"tile": 16}, num_splits=1,
                     order=torch.tensor([2, 2, 0], dtype=torch.int32))
    results["order_followed"] = {"left_out_unwritten": bool(out[1].isnan().all()),
                                 "others_written": bool(torch.isfinite(out[[0, 2]]).all())}
    results["bench"] = _bench_smoke()
    print("RESULTS " + json.dumps(results))


def _bench_smoke() -> dict:
    """bench_shape end to end on CPU tensors (wall-clock timer, fp16), then render its table."""
    import io
    import time

    from rich.console import Console

    from handoff.bench import kernel as bench

    def wall_ms(fn, timer):
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e3

    bench._median_ms = wall_ms
    variants = [{"tile": 16, "num_warps": 4, "num_stages": 1, "waves": 2},
                {"tile": 32, "num_warps": 4, "num_stages": 1, "waves": 8}]
    rows = [bench.bench_shape(block_size=16, batch=2, context=40, heads=(4, 2, 32),
                              kv_dtype=kv, variants=variants, timer="graph", l2_bytes=20_000,
                              num_sms=4, device="cpu", dense=torch.float16, kv_memory=memory)
            for kv, memory in ((torch.float16, "torch"), (torch.float8_e4m3fn, "torch"),
                               (torch.float16, "elastic"))]
    result = {"device": "cpu", "heads": [4, 2, 32], "kv_dtype": "fp16", "timer": "wall",
              "copy_bytes_per_s": 1e10, "default_variant": "16:4:1:2",
              "variants": ["16:4:1:2", "32:4:1:8"], "rows": rows}
    console = Console(file=io.StringIO(), width=200)
    bench.render(result, console)
    return {"rows": rows, "table": console.file.getvalue()}


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return results_under_interpreter(__file__)


def test_the_kernel_starts_row_slots_in_the_order_given(interpreter_results):
    assert interpreter_results["order_followed"] == {"left_out_unwritten": True,
                                                     "others_written": True}


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_kernel_under_interpreter(interpreter_results, name):
    r = interpreter_results[name]
    assert r["finite"], "an output element was left unwritten (NaN poison) or read a free slot"
    assert r["zero_rows_zero"], "a context_len 0 row must be written as zeros"
    assert r["rel_err"] < 5e-3, r


def test_bench_shape_runs_and_agrees_with_sdpa_on_cpu(interpreter_results):
    rows = interpreter_results["bench"]["rows"]
    for row in rows:
        assert row["num_sets"] == -(-3 * 20_000 // row["kv_bytes"])
        assert row["sdpa_backend"] == "FLASH_ATTENTION"
        assert set(row["variants"]) == {"16:4:1:2", "32:4:1:8"}
        for v in row["variants"].values():
            assert v["rel_err"] < 1e-2 and v["bytes_per_s"] > 0, v
    assert rows[1]["kv_bytes"] * 2 == rows[0]["kv_bytes"]  # fp8 reads half the bytes
    assert rows[2]["kv_bytes"] == rows[0]["kv_bytes"]      # the elastic region's copy agreed
    table = interpreter_results["bench"]["table"]
    assert "ours/SDPA" in table and "variants: TB/s" in table


def test_parse_variants():
    from handoff.bench.kernel import parse_variants
    from handoff.errors import HandoffError

    assert parse_variants("64:4:3, 128:8:3:4") == [
        {"tile": 64, "num_warps": 4, "num_stages": 3, "waves": 2},
        {"tile": 128, "num_warps": 8, "num_stages": 3, "waves": 4}]
    assert parse_variants("") == []
    with pytest.raises(HandoffError, match="T:W:S"):
        parse_variants("64:4")


def test_split_count_uses_shapes_and_fills_the_gpu():
    pytest.importorskip("triton")
    from handoff.rollout.kernels import choose_num_splits

    assert choose_num_splits(256, 8, 8192, 64, 132) == 1
    assert choose_num_splits(1, 8, 8192, 64, 132) == 33  # 2 waves of 132 SMs over 8 programs
    assert choose_num_splits(1, 8, 512, 64, 132) == 8    # no more splits than tiles of 64
    assert choose_num_splits(1, 8, 512, 64, 132, min_tiles_per_split=2) == 4
    assert choose_num_splits(1, 1, 1 << 20, 16, 132) == 64  # capped


@pytest.mark.parametrize("change, words", [
    ({"q": torch.zeros(2, 5, 32, dtype=torch.float16)}, ["multiple of kv heads"]),
    ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, ["int32"]),
    ({"k_cache": torch.zeros(4, 16, 2, 32, dtype=torch.float32)}, ["float8_e4m3fn"]),
    ({"out": torch.zeros(2, 8, 32, dtype=torch.float32)}, ["must match q"]),
    ({"num_splits": 0}, ["num_splits=0"]),
    ({"config": {"tile": 24}}, ["power of two"]),
    ({"order": torch.zeros(2, dtype=torch.int64)}, ["order must be", "int32 [2]"]),
])
def test_bad_inputs_raise_clear_errors(change, words):
    pytest.importorskip("triton")
    from handoff.errors import HandoffError
    from handoff.rollout.kernels import paged_decode_attention

    args = {"q": torch.zeros(2, 8, 32, dtype=torch.float16),
            "k_cache": torch.zeros(4, 16, 2, 32, dtype=torch.float16),
            "v_cache": torch.zeros(4, 16, 2, 32, dtype=torch.float16),
            "block_tables": torch.zeros(2, 3, dtype=torch.int32),
            "context_lens": torch.zeros(2, dtype=torch.int32)}
    args.update(change)
    if change.get("k_cache") is not None:
        args["v_cache"] = change["k_cache"]
    kw = {k: args.pop(k) for k in ("out", "num_splits", "config", "order") if k in args}
    with pytest.raises(HandoffError) as e:
        paged_decode_attention(*args.values(), scale=0.1, **kw)
    for w in words:
        assert w in str(e.value)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_oracle_agrees_with_reference_on_cpu():
    case = make_case(5, 3, 2, 4, 32, 16, [33, 100, 1], torch.float32, "cpu", poison=False)
    ref = reference(case)
    assert check(case, flex_paged_decode(case), ref)["rel_err"] < 1e-5
    case["context_lens"][0] = 20  # the mask must follow the lengths
    assert check(case, flex_paged_decode(case), ref)["rel_err"] > 1e-2


def _cuda_ctx(seed: int, batch: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 700, (batch,), generator=gen).tolist()
    if batch > 1:
        ctx[1] = 0  # a padded row, as in a captured batch
    return ctx


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_cuda_bf16_matches_reference(block_size, group, batch):
    for rep, splits in enumerate([None, 1, 5]):
        seed = hash((block_size, group, batch, rep)) % 10_000
        case = make_case(seed, batch, 8, group, 128, block_size, _cuda_ctx(seed, batch),
                         torch.bfloat16, "cuda")
        r = check(case, run_kernel(case, num_splits=splits))
        assert r["finite"] and r["zero_rows_zero"] and r["rel_err"] < 1e-2, (splits, r)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("splits", [None, 1])
def test_cuda_fp8_matches_dequantized_reference(block_size, splits):
    seed = 7 * block_size + (splits or 0)
    case = make_case(seed, 3, 8, 4, 128, block_size, _cuda_ctx(seed, 3), torch.bfloat16, "cuda",
                     fp8=True)
    r = check(case, run_kernel(case, num_splits=splits))
    assert r["finite"] and r["zero_rows_zero"] and r["rel_err"] < 1e-2, r


@cuda
@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("block_size, group", [(16, 4), (64, 8)])
def test_cuda_matches_flex_attention_paged(block_size, group):
    for seed in (1, 2):
        ctx = [n or 1 for n in _cuda_ctx(seed, 4)]
        case = make_case(seed, 4, 8, group, 128, block_size, ctx, torch.bfloat16, "cuda",
                         poison=False)
        ref = flex_paged_decode(case)
        assert check(case, ref)["rel_err"] < 1e-4  # the two oracles agree
        r = check(case, run_kernel(case), ref=ref)
        assert r["finite"] and r["rel_err"] < 1e-2, r


@cuda
@pytest.mark.cuda
def test_cuda_graph_replay_with_new_lengths():
    from handoff.rollout.kernels import paged_decode_attention

    case = make_case(3, 8, 8, 4, 128, 16, [600] * 8, torch.bfloat16, "cuda", poison=False)
    out = torch.empty_like(case["q"])

    def launch():
        paged_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                               case["context_lens"], scale=case["scale"], out=out)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for lens in ([1, 0, 17, 600, 599, 32, 33, 250], [600, 2, 0, 0, 64, 65, 400, 7]):
        case["context_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        case["q"].copy_(torch.randn_like(case["q"]))
        out.fill_(float("nan"))
        graph.replay()
        r = check(case, out)
        assert r["finite"] and r["zero_rows_zero"] and r["rel_err"] < 1e-2, (lens, r)


if __name__ == "__main__":
    _interpreter_main()
