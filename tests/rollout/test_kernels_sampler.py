"""The fused draw (handoff.rollout.kernels.sampler) against the torch sampler's definition.

CPU: the kernel runs under TRITON_INTERPRET=1 in ONE subprocess (this module's __main__).
CUDA (`-m cuda`): the same cases on the GPU, where `sampling.draw` takes the kernel. Each
token is checked against the inverse CDF computed in float64 (the target mass falls in its
interval, up to rounding), against the torch path's token (equal away from boundaries), and
its log-prob against log_softmax(x / T).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from triton_interpreter import results_under_interpreter

# name: (rows, vocab, logit scale, temperatures (cycled), logits dtype, uniform or None: random)
CASES = {
    "one_block": (6, 300, 3.0, (1.0, 0.7), torch.float16, None),
    "many_blocks": (5, 5000, 4.0, (1.0, 0.6, 1.3), torch.float16, None),
    "greedy_rows_among_sampled": (7, 2500, 3.0, (0.0, 1.0, 0.8), torch.float16, None),
    "peaked": (4, 4100, 30.0, (1.0,), torch.float32, None),
    "vocab_not_a_block_multiple": (3, 2049, 2.0, (1.0,), torch.float32, None),
    "top_of_the_cdf": (3, 4500, 2.0, (1.0,), torch.float32, 1.0 - 2.0 ** -53),
    "bottom_of_the_cdf": (3, 4500, 2.0, (1.0,), torch.float32, 0.0),
}


def run_cases(device: str, fused_draw) -> dict:
    from handoff.rollout.sampling import SamplerRows, draw

    results = {}
    gen = torch.Generator().manual_seed(3)
    for name, (rows, vocab, spread, temps, dtype, fixed_u) in CASES.items():
        logits = (torch.randn(rows, vocab, generator=gen) * spread).to(dtype)
        temp = torch.tensor([temps[i % len(temps)] for i in range(rows)], dtype=torch.float32)
        u = torch.rand(rows, generator=gen, dtype=torch.float64)
        if fixed_u is not None:
            u.fill_(fixed_u)
        got_t, got_lp = (t.cpu() for t in fused_draw(logits.to(device), temp.to(device),
                                                       u.to(device)))
        want_t, want_lp = draw(logits, SamplerRows(temperature_B=temp, uniform_B=u,
                                                   top_k_B=None, top_p_B=None))
        x = logits.double() / torch.where(temp == 0, 1.0, temp).double()[:, None]
        p = (x - x.max(-1, keepdim=True).values).exp()
        cdf = p.cumsum(-1)
        target = u * cdf[:, -1]
        in_interval = []
        for i, tok in enumerate(got_t.tolist()):
            if temp[i] == 0:
                in_interval.append(tok == int(x[i].argmax()))
                continue
            lo = cdf[i, tok - 1].item() if tok else 0.0
            slack = 1e-6 * cdf[i, -1].item()
            in_interval.append(lo - slack <= target[i].item() < cdf[i, tok].item() + slack
                               and p[i, tok] > 0)
        results[name] = {"in_interval": all(in_interval),
                         "same_as_torch": int((got_t == want_t).sum()), "rows": rows,
                         "logprob_err": (got_lp - torch.log_softmax(x, -1).gather(
                             1, got_t[:, None]).squeeze(1).float()).abs().max().item(),
                         "torch_logprob_err": (got_lp - want_lp).abs().max().item()
                         if bool((got_t == want_t).all()) else 0.0}
    return results


def _check(results: dict) -> None:
    assert set(results) == set(CASES)
    for name, r in results.items():
        assert r["in_interval"], f"{name}: a token outside its inverse-CDF interval"
        assert r["same_as_torch"] >= r["rows"] - 1, f"{name}: {r} (the torch path's tokens)"
        assert r["logprob_err"] < 2e-4 and r["torch_logprob_err"] < 2e-4, f"{name}: {r}"


def test_fused_draw_follows_the_inverse_cdf_under_interpreter():
    _check(results_under_interpreter(__file__))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_draw_follows_the_inverse_cdf_on_cuda():
    from handoff.rollout.kernels.sampler import fused_draw
    from handoff.rollout.sampling import SamplerRows, draw, fused_draw_applies

    _check(run_cases("cuda", fused_draw))
    # sampling.draw takes the kernel for a sampled draw without truncation, at any batch.
    n = 128
    logits = torch.randn(n, 151_936, device="cuda").to(torch.bfloat16)
    rows = SamplerRows(temperature_B=torch.ones(n, device="cuda"),
                       uniform_B=torch.rand(n, device="cuda", dtype=torch.float64),
                       top_k_B=torch.zeros(n, dtype=torch.int64, device="cuda"),
                       top_p_B=torch.full((n,), 0.9, device="cuda"))
    assert fused_draw_applies(logits, truncate=False)
    assert not fused_draw_applies(logits, truncate=True)
    assert fused_draw_applies(logits[:1], truncate=False)
    assert not fused_draw_applies(logits.float(), truncate=False)   # half precision only
    want = fused_draw(logits, rows.temperature_B, rows.uniform_B)
    for got, expected in zip(draw(logits, rows), want):
        assert torch.equal(got, expected)
    # Captured in a graph (as the runner's sampler graphs do) it draws what it draws eagerly.
    from handoff.rollout.graphs import DecodeGraphs

    out = [torch.empty_like(t) for t in want]

    def step():
        for o, t in zip(out, draw(logits, rows)):
            o.copy_(t)

    graphs = DecodeGraphs([n])
    graphs.capture({(n, "sample"): step}, torch.device("cuda"))
    rows.uniform_B.copy_(torch.rand(n, device="cuda", dtype=torch.float64))
    graphs.replay(n, "sample")
    torch.cuda.synchronize()
    for got, expected in zip(out, fused_draw(logits, rows.temperature_B, rows.uniform_B)):
        assert torch.equal(got, expected)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, os.path.dirname(__file__))
    from handoff.rollout.kernels.sampler import fused_draw

    print("RESULTS " + json.dumps(run_cases("cpu", fused_draw)))
