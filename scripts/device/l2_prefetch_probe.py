"""Does asking for the next product's weight in L2, on a side stream beside the small kernels,
shorten a decode step? (issue 32: at small batch the products reach 60-72% of the copy rate
and HBM idles through attention, the norms and the launches.)

A Qwen3-shaped decoder stack in plain torch (cuBLAS products, SDPA over a 767-token KV),
every layer's weights distinct (so nothing stays in L2 from one step to the next), captured
in one CUDA graph and replayed; each prefetch plan against none in the same process. A plan
names what the side stream asks for once a layer's qkv product is launched
(kernels/prefetch.parse_plan: o_proj's weight, the first MB of gate_up's, of the next layer's
qkv). Floor: weights + KV over the copy rate measured here.
    python3 scripts/device/l2_prefetch_probe.py [--models 1.7b,4b] [--batches 1,32,128]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from handoff.rollout.kernels.prefetch import LayerPrefetch, parse_plan

SHAPES = {"1.7b": dict(E=2048, H=16, KV=8, I=6144, L=28),
          "4b": dict(E=2560, H=32, KV=8, I=9728, L=36)}
D, CTX = 128, 767
PLANS = ["none", "o", "o+gu8", "o+gu16", "o+gu16+qkv8", "o+qkv8"]


def build(s: dict, batch: int):
    E, H, KV, I, L = s["E"], s["H"], s["KV"], s["I"], s["L"]
    dev, dt = "cuda", torch.bfloat16
    layers = []
    for _ in range(L):
        layers.append(dict(
            qkv=torch.randn((H + 2 * KV) * D, E, device=dev, dtype=dt) * 0.02,
            o=torch.randn(E, H * D, device=dev, dtype=dt) * 0.02,
            gu=torch.randn(2 * I, E, device=dev, dtype=dt) * 0.02,
            down=torch.randn(E, I, device=dev, dtype=dt) * 0.02,
            k=torch.randn(batch, KV, CTX, D, device=dev, dtype=dt),
            v=torch.randn(batch, KV, CTX, D, device=dev, dtype=dt)))
    return layers


def forward(s, layers, x, prefetch):
    E, H, I = s["E"], s["H"], s["I"]
    for i, w in enumerate(layers):
        h = F.rms_norm(x, (E,))
        qkv = h @ w["qkv"].t()
        if prefetch is not None:
            prefetch.after_qkv(i)
        q = qkv[:, :H * D].reshape(-1, H, 1, D)
        a = F.scaled_dot_product_attention(q, w["k"], w["v"], enable_gqa=True)
        x = x + a.reshape(-1, H * D) @ w["o"].t()
        h = F.rms_norm(x, (E,))
        gu = h @ w["gu"].t()
        x = x + (F.silu(gu[:, :I]) * gu[:, I:]) @ w["down"].t()
        if prefetch is not None:
            prefetch.join()
    return x


def copy_rate() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) / 1e3)


def time_graph(fn, reps=60) -> tuple[float, torch.Tensor]:
    """(median ms of a replay of `fn` captured in one graph, the graph's output)."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fn()
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="1.7b,4b")
    p.add_argument("--batches", default="1,32,128")
    args = p.parse_args()
    rate = copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s")
    rows = []
    for name in args.models.split(","):
        s = SHAPES[name]
        for batch in map(int, args.batches.split(",")):
            torch.manual_seed(0)
            layers = build(s, batch)
            nbytes = sum(t.numel() * 2 for w in layers for t in w.values())
            floor_ms = nbytes / rate * 1e3
            x = torch.randn(batch, s["E"], device="cuda", dtype=torch.bfloat16)
            side = torch.cuda.Stream()
            weights = [(w["o"], w["gu"], w["qkv"]) for w in layers]
            base = None
            for plan in PLANS:
                prefetch = (None if plan == "none"
                            else LayerPrefetch(weights, parse_plan(plan), side))
                ms, out = time_graph(lambda: forward(s, layers, x, prefetch))
                if base is None:
                    base, ref = ms, out.clone()
                same = torch.equal(out, ref)
                rows.append((name, batch, plan, ms, floor_ms, base, same))
                print(f"{name} b{batch} {plan}: {ms:.3f} ms ({ms / floor_ms:.2f}x floor, "
                      f"{base / ms:.3f}x faster, same output {same})", flush=True)
            del layers
            torch.cuda.empty_cache()
    print("\n| model | batch | plan | ms | x floor | vs none | same output |\n|---|---|---|---|---|---|---|")
    for name, batch, plan, ms, floor_ms, base, same in rows:
        print(f"| {name} | {batch} | {plan} | {ms:.3f} | {ms / floor_ms:.2f} | "
              f"{base / ms:.3f} | {same} |")


if __name__ == "__main__":
    main()
