"""Oracles for the paged decode kernel tests: random paged caches, a float32 gather reference,
FlexAttention's paged mode, and the checks (relative error, every element written).

Shape legend: B batch, H query heads, K kv heads, G group (H // K), D head_dim, L tokens.
"""

from __future__ import annotations

import torch

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


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids], through a byte view for fp8 (not every device indexes fp8 directly)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[block_ids].view(cache.dtype)
    return cache[block_ids]


def reference(case: dict) -> torch.Tensor:
    """Gather the blocks and run attention in float32 (masked slots zeroed, so NaN never leaks)."""
    q, kc, vc, bt, ctx = (case[n] for n in ("q", "k_cache", "v_cache", "block_tables",
                                            "context_lens"))
    B, H, D = q.shape
    _, bs, K, _ = kc.shape
    idx = bt.clamp(min=0).long()
    k_BLKD = gather_blocks(kc, idx).float().reshape(B, -1, K, D)
    v_BLKD = gather_blocks(vc, idx).float().reshape(B, -1, K, D)
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


def prefill_reference(case: dict, q_THD: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
    """Each sequence's queries are its last query_lens[b] positions; float32, causal."""
    kc, vc, bt = case["k_cache"], case["v_cache"], case["block_tables"]
    _, bs, K, D = kc.shape
    H = q_THD.shape[1]
    outs, start = [], 0
    for b, nq in enumerate(query_lens):
        nk = int(case["context_lens"][b])
        ids = bt[b, :-(-nk // bs)].long()
        k_LKD = gather_blocks(kc, ids).float().reshape(-1, K, D)[:nk]
        v_LKD = gather_blocks(vc, ids).float().reshape(-1, K, D)[:nk]
        if case["k_scale"] is not None:
            k_LKD, v_LKD = k_LKD * case["k_scale"].float(), v_LKD * case["v_scale"].float()
        k_LHD = k_LKD.repeat_interleave(H // K, dim=1)
        v_LHD = v_LKD.repeat_interleave(H // K, dim=1)
        s_HQL = torch.einsum("qhd,lhd->hql", q_THD[start:start + nq].float(), k_LHD)
        keep_QL = torch.arange(nk, device=q_THD.device)[None, :] <= \
            torch.arange(nq, device=q_THD.device)[:, None] + (nk - nq)
        p_HQL = torch.softmax((s_HQL * case["scale"]).masked_fill(~keep_QL, float("-inf")), -1)
        outs.append(torch.einsum("hql,lhd->qhd", p_HQL, v_LHD))
        start += nq
    return torch.cat(outs)
