"""Tests of the Triton paged decode kernel (handoff.rollout.kernels.paged_decode).

CPU: the kernel itself runs under TRITON_INTERPRET=1 in ONE subprocess (the variable must be set
before Triton decorates the kernels, and other test modules import Triton normally); there the
inputs are fp16 because the interpreter's tl.dot mishandles bf16. CUDA (`-m cuda`): bf16 and fp8
across block sizes, GQA ratios, batch sizes and context lengths against a float32 reference and
FlexAttention, plus a CUDA-graph replay with new lengths. Every check draws fresh inputs,
poisons the output and the unused cache slots with NaN, and compares by ||out-ref|| / ||ref||.
Shape legend: B batch, H query heads, K kv heads, G group (H // K), D head_dim, L tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_case(seed: int, batch: int, num_kv_heads: int, group: int, head_dim: int,
              block_size: int, ctx_lens: list[int], dtype: torch.dtype, device: str,
              fp8: bool = False, poison: bool = True) -> dict:
    """Random q and a paged cache whose blocks are scattered; free slots hold NaN if poison."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(per_seq) + sum(per_seq) // 2 + 3
    max_blocks = max(per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    nxt = 0
    for b, (n, nb) in enumerate(zip(ctx_lens, per_seq)):
        blocks = perm[nxt:nxt + nb]
        nxt += nb
        block_tables[b, :nb] = blocks.to(torch.int32)
        used.view(-1)[(blocks[:, None] * block_size + torch.arange(block_size)).view(-1)[:n]] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    case = {"scale": head_dim ** -0.5, "k_scale": None, "v_scale": None}
    k_scale, v_scale = k.abs().max() / 448.0, v.abs().max() / 448.0
    if poison:
        free = ~used[:, :, None, None].expand(shape)
        k[free] = float("nan")
        v[free] = float("nan")
    if fp8:
        k, v = (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)
        case["k_scale"] = k_scale.reshape(1).to(device)
        case["v_scale"] = v_scale.reshape(1).to(device)
    else:
        k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    case.update(q=q.to(device), k_cache=k.to(device), v_cache=v.to(device),
                block_tables=block_tables.to(device),
                context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device))
    return case


def reference(case: dict) -> torch.Tensor:
    """Gather the blocks and run attention in float32 (masked slots zeroed, so NaN never leaks)."""
    q, kc, vc, bt, ctx = (case[n] for n in ("q", "k_cache", "v_cache", "block_tables",
                                            "context_lens"))
    B, H, D = q.shape
    _, bs, K, _ = kc.shape
    idx = bt.clamp(min=0).long()
    k_BLKD = kc[idx].float().reshape(B, -1, K, D)
    v_BLKD = vc[idx].float().reshape(B, -1, K, D)
    if case["k_scale"] is not None:
        k_BLKD, v_BLKD = k_BLKD * case["k_scale"].float(), v_BLKD * case["v_scale"].float()
    valid_BL = torch.arange(k_BLKD.shape[1], device=q.device)[None, :] < ctx[:, None].long()
    k_BLKD = torch.where(valid_BL[:, :, None, None], k_BLKD, 0.0)
    v_BLKD = torch.where(valid_BL[:, :, None, None], v_BLKD, 0.0)
    q_BKGD = q.float().view(B, K, H // K, D)
    s_BKGL = torch.einsum("bkgd,blkd->bkgl", q_BKGD, k_BLKD) * case["scale"]
    s_BKGL = s_BKGL.masked_fill(~valid_BL[:, None, None, :], float("-inf"))
    p_BKGL = torch.softmax(s_BKGL, dim=-1).nan_to_num(0.0)
    return torch.einsum("bkgl,blkd->bkgd", p_BKGL, v_BLKD).reshape(B, H, D)


def flex_paged_decode(case: dict) -> torch.Tensor:
    """FlexAttention's paged mode as a second oracle: the whole physical cache is one KV
    sequence and a block mask built from the block table picks each row's slots (blocks must
    not be shared between rows; free slots must hold finite values). Eager mode: slow, exact."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, kc, vc, bt, ctx = (case[n] for n in ("q", "k_cache", "v_cache", "block_tables",
                                            "context_lens"))
    B, H, D = q.shape
    num_blocks, bs, K, _ = kc.shape
    owner = torch.full((num_blocks,), -1, dtype=torch.long, device=q.device)
    logical = torch.zeros(num_blocks, dtype=torch.long, device=q.device)
    rows = torch.arange(B, device=q.device)[:, None].expand_as(bt)
    cols = torch.arange(bt.shape[1], device=q.device)[None, :].expand_as(bt)
    used = (cols * bs < ctx[:, None]) & (bt >= 0)
    owner[bt[used].long()] = rows[used]
    logical[bt[used].long()] = cols[used]
    ctx_long = ctx.long()

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // bs
        return (owner[blk] == b) & (logical[blk] * bs + kv_idx % bs < ctx_long[b])

    mask = create_block_mask(mask_mod, B, None, 1, num_blocks * bs, device=q.device)
    k_1KSD = kc.float().reshape(1, num_blocks * bs, K, D).transpose(1, 2)
    v_1KSD = vc.float().reshape(1, num_blocks * bs, K, D).transpose(1, 2)
    out = flex_attention(q.float()[:, :, None, :], k_1KSD.expand(B, -1, -1, -1),
                         v_1KSD.expand(B, -1, -1, -1), block_mask=mask, scale=case["scale"],
                         enable_gqa=True)
    return out[:, :, 0, :]


def run_kernel(case: dict, **kw) -> torch.Tensor:
    from handoff.rollout.kernels import paged_decode_attention

    out = torch.full_like(case["q"], float("nan"))
    res = paged_decode_attention(case["q"], case["k_cache"], case["v_cache"],
                                 case["block_tables"], case["context_lens"], scale=case["scale"],
                                 k_scale=case["k_scale"], v_scale=case["v_scale"], out=out, **kw)
    assert res is out
    return out


def check(case: dict, out: torch.Tensor, ref: torch.Tensor | None = None) -> dict:
    ref = reference(case) if ref is None else ref
    zero_rows = case["context_lens"] == 0
    return {"rel_err": ((out.float() - ref).norm() / ref.norm()).item(),
            "finite": bool(torch.isfinite(out).all()),
            "zero_rows_zero": bool((out[zero_rows] == 0).all())}


# name: (batch, kv heads, group, head_dim, block_size, context lens, kwargs of the call, fp8)
INTERP_CASES = {
    "gqa4_bs16_multi_tile": (3, 2, 4, 32, 16, [1, 17, 50], {"num_splits": 1}, False),
    "split3_with_empty_row": (3, 1, 2, 32, 16, [0, 45, 33], {"num_splits": 3}, False),
    "block24_not_pow2_gqa8": (2, 1, 8, 16, 24, [70, 5], {"num_splits": 2}, False),
    "block64_larger_than_tile": (2, 2, 1, 32, 64, [100, 64], {"config": {"tile": 32}}, False),
    "head_dim24_padded": (1, 2, 2, 24, 16, [20], {"num_splits": 2}, False),
    "fp8_scales_split": (2, 2, 4, 32, 16, [30, 47], {"num_splits": 2}, True),
}


def _fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns a run-time loop
    bound into an int with int(array), which numpy >= 2.4 refuses; read the element instead."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _interpreter_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _fix_interpreter_loop_bounds()
    results = {}
    for i, (name, (B, K, G, D, bs, ctx, kw, fp8)) in enumerate(INTERP_CASES.items()):
        kw = {"config": {"tile": 16}, **kw}
        case = make_case(100 + i, B, K, G, D, bs, ctx, torch.float16, "cpu", fp8=fp8)
        results[name] = check(case, run_kernel(case, **kw))
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_kernel_under_interpreter(interpreter_results, name):
    r = interpreter_results[name]
    assert r["finite"], "an output element was left unwritten (NaN poison) or read a free slot"
    assert r["zero_rows_zero"], "a context_len 0 row must be written as zeros"
    assert r["rel_err"] < 5e-3, r


def test_split_count_uses_shapes_and_fills_the_gpu():
    pytest.importorskip("triton")
    from handoff.rollout.kernels import choose_num_splits

    assert choose_num_splits(256, 8, 8192, 64, 132) == 1
    assert choose_num_splits(1, 8, 8192, 64, 132) == 33  # 2 waves of 132 SMs over 8 programs
    assert choose_num_splits(1, 8, 512, 64, 132) == 4    # at least 2 tiles of 64 per split
    assert choose_num_splits(1, 1, 1 << 20, 16, 132) == 64  # capped


@pytest.mark.parametrize("change, words", [
    ({"q": torch.zeros(2, 5, 32, dtype=torch.float16)}, ["multiple of kv heads"]),
    ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, ["int32"]),
    ({"k_cache": torch.zeros(4, 16, 2, 32, dtype=torch.float32)}, ["float8_e4m3fn"]),
    ({"out": torch.zeros(2, 8, 32, dtype=torch.float32)}, ["must match q"]),
    ({"num_splits": 0}, ["num_splits=0"]),
    ({"config": {"tile": 24}}, ["power of two"]),
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
    kw = {k: args.pop(k) for k in ("out", "num_splits", "config") if k in args}
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
