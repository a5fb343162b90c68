"""`handoff bench kernel`: the Triton paged decode kernel alone, against SDPA and the copy floor.

    handoff bench kernel --out kernel.json                       # Qwen3 shapes, bf16, CUDA only
    handoff bench kernel --variants 64:4:3,64:4:5,128:4:3:4      # also time other launch configs
    handoff bench kernel --prefill                               # plus varlen prefill timings

For each block size x batch x context (every sequence at that length, blocks scattered over the
pool) it times paged_decode_attention and SDPA (flash / efficient / cuDNN, the best that runs)
on the same K/V laid out contiguously [batch, kv_heads, context, head_dim], and reports
bytes/s = (K+V bytes read + q and out bytes) / median time; the acceptance target is >= 70% of
SDPA's. Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph: no launch
gaps, as in the engine's graph decode), each graph rotating over enough input sets that one pass
reads >= 3x the L2, so no call is served from the cache. The device-to-device copy rate (bytes
read + written) is measured once as the floor. A variant "T:W:S[:X]" is tile tokens, num_warps,
num_stages and, optionally, target waves of programs for the split count (default 2).
"""

from __future__ import annotations

import datetime
import itertools
import math
from functools import partial

import torch

from handoff.errors import HandoffError

SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def parse_variants(spec: str) -> list[dict]:
    """"64:4:3,128:4:3:4" -> [{"tile": 64, "num_warps": 4, "num_stages": 3, "waves": 2}, ...]."""
    variants = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
            raise HandoffError(f"--variants item {item!r} is not T:W:S or T:W:S:X (integers): "
                               "write e.g. 64:4:3,128:8:3:4")
        t, w, s = (int(p) for p in parts[:3])
        variants.append({"tile": t, "num_warps": w, "num_stages": s,
                         "waves": int(parts[3]) if len(parts) == 4 else 2})
    return variants


def _variant_name(v: dict) -> str:
    return f"{v['tile']}:{v['num_warps']}:{v['num_stages']}:{v['waves']}"


def _median_ms(fn, timer: str) -> float:
    import triton.testing

    if timer == "graph":
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), "events")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def _rotate(calls: list):
    it = itertools.cycle(calls)
    return lambda: next(it)()


def _sdpa_call(backend, q_BH1D, k_BKLD, v_BKLD, scale):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(
            q_BH1D, k_BKLD, v_BKLD, scale=scale, enable_gqa=True)


def bench_shape(*, block_size: int, batch: int, context: int, heads: tuple[int, int, int],
                kv_dtype: torch.dtype, variants: list[dict], timer: str, l2_bytes: int,
                num_sms: int, device: str = "cuda", dense: torch.dtype = torch.bfloat16,
                kv_memory: str = "torch") -> dict:
    """Time one shape: our kernel with each variant (the first is the default) and SDPA.

    device/dense exist for the CPU smoke test (Triton interpreter, fp16); the bench uses CUDA.
    kv_memory="elastic" puts the K and V pools in an elastic region (two slabs, mapped whole
    through the driver's VMM), as rollout.kv_pool=elastic does.
    """
    from torch.nn.attention import SDPBackend

    from handoff.rollout.kernels import choose_num_splits, paged_decode_attention

    H, K, D = heads
    blocks_per_seq = -(-context // block_size)
    kv_bytes = 2 * batch * context * K * D * torch.empty((), dtype=kv_dtype).element_size()
    io_bytes = 2 * batch * H * D * dense.itemsize
    num_sets = max(1, min(64, math.ceil(3 * l2_bytes / kv_bytes)))
    num_blocks = num_sets * batch * blocks_per_seq
    pool_shape = (num_blocks, block_size, K, D)
    k_pool, v_pool = torch.randn(pool_shape, device=device, dtype=dense), \
        torch.randn(pool_shape, device=device, dtype=dense)
    k_scale = v_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        k_scale = (k_pool.abs().amax().float() / 448.0).reshape(1)
        v_scale = (v_pool.abs().amax().float() / 448.0).reshape(1)
        k_pool = (k_pool / k_scale).to(kv_dtype)
        v_pool = (v_pool / v_scale).to(kv_dtype)
    arena = None
    if kv_memory == "elastic":
        arena, (k_pool, v_pool) = _in_elastic_region(k_pool, v_pool)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    # One allocation per table keeps every set's pointer alignment (and so Triton's
    # specialization) the same: no compile may happen inside a graph capture.
    tables = [perm[i * batch * blocks_per_seq:(i + 1) * batch * blocks_per_seq]
              .view(batch, blocks_per_seq).clone() for i in range(num_sets)]
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qs = [torch.randn(batch, H, D, device=device, dtype=dense) for _ in range(num_sets)]
    outs = [torch.empty_like(q) for q in qs]
    scale = D ** -0.5

    def dense_kv(pool, s, kv_scale):
        raw = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
        x_BLKD = raw[tables[s].long()].view(pool.dtype)
        x_BLKD = x_BLKD.reshape(batch, blocks_per_seq * block_size, K, D)
        x_BLKD = x_BLKD[:, :context].to(dense) if kv_scale is None else \
            (x_BLKD[:, :context].float() * kv_scale).to(dense)
        return x_BLKD.transpose(1, 2).contiguous()

    ks = [dense_kv(k_pool, s, k_scale) for s in range(num_sets)]
    vs = [dense_kv(v_pool, s, v_scale) for s in range(num_sets)]
    q4s = [q.view(batch, H, 1, D) for q in qs]
    row = {"block_size": block_size, "batch": batch, "context": context, "num_sets": num_sets,
           "kv_bytes": kv_bytes, "variants": {}}

    best_sdpa = None
    for name in SDPA_BACKENDS:
        backend = getattr(SDPBackend, name)
        try:
            ref = _sdpa_call(backend, q4s[0], ks[0], vs[0], scale)
            ms = _median_ms(_rotate([partial(_sdpa_call, backend, q4s[s], ks[s], vs[s], scale)
                                     for s in range(num_sets)]), timer)
        except Exception as e:  # a backend that cannot run this shape (or be captured)
            row[f"sdpa_{name.lower()}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        dense_bytes = 2 * batch * context * K * D * dense.itemsize + io_bytes
        row[f"sdpa_{name.lower()}_us"] = ms * 1e3
        if best_sdpa is None or ms < best_sdpa[1]:
            best_sdpa = (name, ms, dense_bytes / (ms * 1e-3), ref.view(batch, H, D).float())
    for v in variants:
        cfg = {k: v[k] for k in ("tile", "num_warps", "num_stages")}
        splits = choose_num_splits(batch, K, blocks_per_seq * block_size, v["tile"], num_sms,
                                   waves=v["waves"])
        calls = [partial(paged_decode_attention, qs[s], k_pool, v_pool, tables[s], lens,
                         scale=scale, k_scale=k_scale, v_scale=v_scale, out=outs[s],
                         num_splits=splits, config=cfg) for s in range(num_sets)]
        try:  # one config out of resources must not cost the rest of the run
            calls[0]()
            err = None
            if best_sdpa is not None:
                ref = best_sdpa[3]
                err = ((outs[0].float() - ref).norm() / ref.norm()).item()
            ms = _median_ms(_rotate(calls), timer)
        except Exception as e:
            row["variants"][_variant_name(v)] = {"error": f"{type(e).__name__}: {str(e)[:160]}",
                                                 "splits": splits}
            continue
        row["variants"][_variant_name(v)] = {"us": ms * 1e3, "splits": splits, "rel_err": err,
                                             "bytes_per_s": (kv_bytes + io_bytes) / (ms * 1e-3)}
    if best_sdpa is not None:
        row.update(sdpa_backend=best_sdpa[0], sdpa_us=best_sdpa[1] * 1e3,
                   sdpa_bytes_per_s=best_sdpa[2])
    if arena is not None:
        arena.close()
    return row


def _in_elastic_region(*pools: torch.Tensor):
    """Copies of `pools` (same shape and dtype) in one elastic region, a slab each."""
    from handoff.memory.elastic import ElasticArena

    nbytes = pools[0].numel() * pools[0].element_size()
    granule = ElasticArena.granule_bytes(pools[0].device)
    slab = -(-nbytes // granule) * granule
    arena = ElasticArena(pools[0].device, slabs=len(pools), slab_bytes=slab)
    arena.grow_to(slab)
    flat = arena.view(torch.uint8, (len(pools), slab))
    copies = []
    for i, pool in enumerate(pools):
        dst = flat[i, :nbytes].view(pool.dtype).view(pool.shape)
        dst.copy_(pool)
        copies.append(dst)
    return arena, copies


def run_kernel_bench(*, batches: list[int], contexts: list[int], block_sizes: list[int],
                     variants: list[dict], kv_dtype: str = "bfloat16", timer: str = "graph",
                     heads: tuple[int, int, int] = (32, 8, 128), prefill: bool = False,
                     kv_memory: str = "torch") -> dict:
    """Run every shape; the first variant is the kernel's default config. Returns a JSON dict."""
    import triton

    from handoff.rollout.kernels import default_config

    if not torch.cuda.is_available():
        raise HandoffError("bench kernel times a Triton CUDA kernel but no CUDA GPU is visible: "
                           "run it on the GPU machine")
    dtypes = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
              "float8_e4m3fn": torch.float8_e4m3fn}
    if kv_memory not in ("torch", "elastic"):
        raise HandoffError(f"--kv-memory {kv_memory}: choose torch (cudaMalloc via torch) or "
                           "elastic (the elastic pool's VMM region)")
    if kv_dtype not in dtypes or timer not in ("graph", "events"):
        raise HandoffError(f"--kv-dtype {kv_dtype} / --timer {timer}: choose kv dtype from "
                           f"{sorted(dtypes)} and timer from graph, events")
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    default = {**default_config(heads[2]), "waves": 2}
    all_variants = [default] + [v for v in variants if v != default]
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": props.name, "num_sms": props.multi_processor_count,
              "l2_bytes": l2_bytes, "torch": torch.__version__, "triton": triton.__version__,
              "timer": timer, "kv_dtype": kv_dtype, "kv_memory": kv_memory, "heads": list(heads),
              "default_variant": _variant_name(default),
              "variants": [_variant_name(v) for v in all_variants],
              "copy_bytes_per_s": copy_bandwidth(), "rows": []}
    for bs, b, ctx in itertools.product(block_sizes, batches, contexts):
        result["rows"].append(bench_shape(
            block_size=bs, batch=b, context=ctx, heads=heads, kv_dtype=dtypes[kv_dtype],
            variants=all_variants, timer=timer, l2_bytes=l2_bytes,
            num_sms=props.multi_processor_count, kv_memory=kv_memory))
        torch.cuda.empty_cache()
    if prefill:
        result["prefill"] = bench_prefill(num_seqs=[8, 64], prompt_lens=[256, 1024],
                                          heads=heads)
    return result


def bench_prefill(*, num_seqs: list[int], prompt_lens: list[int], block_size: int = 16,
                  heads: tuple[int, int, int] = (32, 8, 128)) -> list[dict]:
    """paged_prefill_attention (gather + varlen_attn, eager as the engine runs prefill) against
    varlen_attn alone on K/V already packed: the difference is what the gather costs."""
    from handoff.rollout.kernels.prefill import paged_prefill_attention, varlen_attention

    H, K, D = heads
    rows = []
    for n, p in itertools.product(num_seqs, prompt_lens):
        nb = -(-p // block_size)
        k_pool = torch.randn(n * nb, block_size, K, D, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        tables = torch.randperm(n * nb, device="cuda").to(torch.int32).view(n, nb)
        q_THD = torch.randn(n * p, H, D, device="cuda", dtype=torch.bfloat16)
        k_LKD = torch.randn(n * p, K, D, device="cuda", dtype=torch.bfloat16)
        v_LKD = torch.randn_like(k_LKD)
        cu = torch.arange(0, n * p + 1, p, device="cuda", dtype=torch.int32)
        lens, scale = [p] * n, D ** -0.5
        paged_ms = _median_ms(lambda: paged_prefill_attention(
            q_THD, k_pool, v_pool, tables, lens, lens, scale=scale), "events")
        packed_ms = _median_ms(lambda: varlen_attention(q_THD, k_LKD, v_LKD, cu, cu, p, p, scale=scale),
                               "events")
        flops = 4 * n * H * D * p * (p + 1) / 2  # causal: QK^T and PV over the kept half
        rows.append({"num_seqs": n, "prompt_len": p, "paged_ms": paged_ms,
                     "packed_ms": packed_ms, "paged_tflops": flops / paged_ms / 1e9,
                     "packed_tflops": flops / packed_ms / 1e9})
        del k_pool, v_pool, q_THD, k_LKD, v_LKD
        torch.cuda.empty_cache()
    return rows


def render(result: dict, console) -> None:
    """Print the main table (default config vs SDPA) and, with variants, their TB/s."""
    from rich.table import Table

    width = max(console.width, 150)  # logs (no tty) default to 80 columns: too narrow

    copy = result["copy_bytes_per_s"]
    default = result["default_variant"]
    t = Table(title=f"paged decode, {result['device']}, heads {result['heads']}, KV "
                    f"{result['kv_dtype']}, timer {result['timer']}; copy floor "
                    f"{copy / 1e12:.2f} TB/s; config {default} (T:W:S:waves)")
    for col in ("block", "batch", "ctx", "splits", "ours us", "ours TB/s", "SDPA", "SDPA us",
                "SDPA TB/s", "ours/SDPA", "ours/copy", "err"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        ours = r["variants"][default]
        if "error" in ours:
            t.add_row(str(r["block_size"]), str(r["batch"]), str(r["context"]), "-",
                      f"[red]{ours['error'][:60]}[/]", *["-"] * 7)
            continue
        sdpa_bw = r.get("sdpa_bytes_per_s")
        ratio = f"{ours['bytes_per_s'] / sdpa_bw:.0%}" if sdpa_bw else "-"
        err = "-" if ours["rel_err"] is None else f"{ours['rel_err']:.1e}"
        if ours["rel_err"] is not None and not ours["rel_err"] < 1e-2:
            err = f"[red]{err}[/]"
        t.add_row(str(r["block_size"]), str(r["batch"]), str(r["context"]), str(ours["splits"]),
                  f"{ours['us']:.1f}", f"{ours['bytes_per_s'] / 1e12:.2f}",
                  r.get("sdpa_backend", "none")[:5].lower(), f"{r.get('sdpa_us', 0):.1f}",
                  f"{(sdpa_bw or 0) / 1e12:.2f}", ratio,
                  f"{ours['bytes_per_s'] / copy:.0%}", err)
    console.print(t, width=width)
    if len(result["variants"]) > 1:
        v = Table(title="variants: TB/s of our kernel (T:W:S:waves), best per row in bold")
        for col in ["block", "batch", "ctx"] + result["variants"]:
            v.add_column(col, justify="right")
        for r in result["rows"]:
            bws = [r["variants"][n].get("bytes_per_s", 0.0) for n in result["variants"]]
            cells = ["fail" if x == 0.0 else f"[bold]{x / 1e12:.2f}[/]" if x == max(bws)
                     else f"{x / 1e12:.2f}" for x in bws]
            v.add_row(str(r["block_size"]), str(r["batch"]), str(r["context"]), *cells)
        console.print(v, width=width)
    if result.get("prefill"):
        p = Table(title="prefill (bf16, block 16): paged = gather + varlen_attn; packed = "
                        "varlen_attn on K/V already packed")
        for col in ("seqs", "prompt", "paged ms", "paged TFLOP/s", "packed ms",
                    "packed TFLOP/s"):
            p.add_column(col, justify="right")
        for r in result["prefill"]:
            p.add_row(str(r["num_seqs"]), str(r["prompt_len"]), f"{r['paged_ms']:.3f}",
                      f"{r['paged_tflops']:.0f}", f"{r['packed_ms']:.3f}",
                      f"{r['packed_tflops']:.0f}")
        console.print(p, width=width)
