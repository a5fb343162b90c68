"""How fast copies run into memory right after a large region went to sleep, and why.

    python3 scripts/h2d_after_unmap.py      # on the device, after `source scripts/device-env.sh`

to_train puts the engine to sleep (its KV pool, most of the card, goes back to the driver)
and then copies the trainer's parameters in. This times such copies (CUDA events per 256 MiB
chunk on a side stream, pinned source) in the cases that tell the causes apart:

* into fresh memory at waits of 0-1 s after the sleep (how long the slow window lasts);
* into memory allocated before the sleep (slow too: the copy engines are busy elsewhere;
  fast: only fresh pages cost);
* after sleeps of 25, 50 and 100 GiB (does the window grow with the bytes released?);
* a kernel writing fresh memory instead of a copy engine (does the SM path pay as well?);
* the same H2D done by a kernel reading the pinned source (handoff.memory.host_copy), from
  torch's pinned memory and from memory pinned with cudaHostRegister (as the arena pins).

Each row: total seconds, GB/s, and `slow until`, when the last chunk below 0.8x the link's
rate ended (seconds from the first chunk's start; 0 = none was slow).
"""

import time

import torch

from handoff.memory.regions import RegionPool

from handoff.memory.allocator import aggressive_empty_cache
from handoff.memory.host_copy import copy_from_host

GiB = 1 << 30
CHUNK = 256 << 20
DEVICE = torch.device("cuda")


def timed_chunks(dst: torch.Tensor, src: torch.Tensor | None,
                 sm: bool = False) -> list[tuple[float, int]]:
    """(end seconds, bytes) per chunk: an H2D copy from `src` (by a kernel with `sm`), or a
    fill kernel if None."""
    stream = torch.cuda.Stream()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(-(-dst.numel() // CHUNK) + 1)]
    sizes = []
    with torch.cuda.stream(stream):
        events[0].record(stream)
        for i, lo in enumerate(range(0, dst.numel(), CHUNK)):
            piece = dst[lo:lo + CHUNK]
            if src is None:
                piece.fill_(7)
            elif sm:
                copy_from_host(piece, src[lo:lo + piece.numel()])
            else:
                piece.copy_(src[lo:lo + piece.numel()], non_blocking=True)
            sizes.append(piece.numel())
            events[i + 1].record(stream)
    stream.synchronize()
    return [(events[0].elapsed_time(e) / 1e3, n) for e, n in zip(events[1:], sizes)]


def summary(chunks: list[tuple[float, int]], link_bps: float) -> tuple[float, float, float]:
    """(seconds, bytes/s, slow until)."""
    slow_until, prev = 0.0, 0.0
    for end, n in chunks:
        if n / max(end - prev, 1e-9) < 0.8 * link_bps:
            slow_until = end
        prev = end
    total = chunks[-1][0]
    return total, sum(n for _, n in chunks) / total, slow_until


def main(copy_gib: float = 7.5) -> None:
    nbytes = int(copy_gib * GiB)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    registered = torch.empty(nbytes, dtype=torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(registered.data_ptr(), nbytes, 0)) == 0
    registered[:1 << 20].random_(0, 255)
    pool = RegionPool(DEVICE)
    regions = {}
    for gib in (100, 50, 25):   # one region per size released; asleep, each holds nothing
        tag = f"region{gib}"
        with pool.region(tag):
            regions[gib] = torch.empty(gib * GiB, dtype=torch.uint8, device=DEVICE)
        pool.track(tag, [regions[gib]])
        pool.sleep([tag], level=2)
    kept = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)   # allocated all along
    timed_chunks(kept, src)
    link = summary(timed_chunks(kept, src), 1.0)[1]
    timed_chunks(kept, None)
    fill = summary(timed_chunks(kept, None), 1.0)[1]
    timed_chunks(kept, src, sm=True)
    sm_link = summary(timed_chunks(kept, src, sm=True), 1.0)[1]
    sm_reg = summary(timed_chunks(kept, registered, sm=True), 1.0)[1]
    assert torch.equal(kept[:1 << 20].cpu(), registered[:1 << 20])
    print(f"{copy_gib} GiB per case; link {link / 1e9:.1f} GB/s, fill kernel {fill / 1e12:.2f} "
          f"TB/s, SM copy {sm_link / 1e9:.1f} GB/s ({sm_reg / 1e9:.1f} from registered memory) "
          "(into memory allocated all along, nothing released)")
    # (name, GiB the sleep releases, wait after it, destination, copy or kernel)
    cases = [("fresh, right after", 100, 0.0, "fresh", "h2d"),
             ("fresh, right after (again)", 100, 0.0, "fresh", "h2d"),
             ("fresh, 0.2 s after", 100, 0.2, "fresh", "h2d"),
             ("fresh, 1 s after", 100, 1.0, "fresh", "h2d"),
             ("allocated before the sleep", 100, 0.0, "kept", "h2d"),
             ("fresh, 50 GiB released", 50, 0.0, "fresh", "h2d"),
             ("fresh, 25 GiB released", 25, 0.0, "fresh", "h2d"),
             ("fill kernel, fresh", 100, 0.0, "fresh", "fill"),
             ("fill kernel, allocated before", 100, 0.0, "kept", "fill"),
             ("SM copy, fresh, right after", 100, 0.0, "fresh", "sm"),
             ("SM copy, allocated before", 100, 0.0, "kept", "sm"),
             ("SM copy (registered), fresh", 100, 0.0, "fresh", "sm-registered"),
             ("copy_, fresh, right after (again)", 100, 0.0, "fresh", "h2d")]
    print(f"{'case':<34}{'released':>9}{'seconds':>9}{'rate':>8}{'slow until':>12}")
    for name, gib, wait_s, where, how in cases:
        tag = f"region{gib}"
        pool.wake_up([tag])
        regions[gib].fill_(1)   # a step's KV pool goes to sleep written
        torch.cuda.synchronize()
        time.sleep(1.0)         # the wake's own pages settle first
        pool.sleep([tag], level=2)
        time.sleep(wait_s)
        dst = kept if where == "kept" else torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        source = {"h2d": src, "sm": src, "sm-registered": registered}.get(how)
        seconds, rate, slow_until = summary(timed_chunks(dst, source, sm=how.startswith("sm")),
                                            fill if how == "fill" else link)
        unit = "TB/s" if how == "fill" else "GB/s"
        print(f"{name:<34}{gib:>5} GiB{seconds:9.3f}{rate / (1e12 if how == 'fill' else 1e9):8.2f}"
              f"{slow_until:12.3f}  {unit}")
        del dst
        aggressive_empty_cache()
        time.sleep(2.0)         # the next case starts with the driver idle


if __name__ == "__main__":
    main()
