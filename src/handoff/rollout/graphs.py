"""Decode as CUDA graphs: the batch-size ladder, the static decode inputs, capture and replay.

A decode step of n sequences runs at the smallest ladder size b >= n (1, 2, 4, 8, 16, 32, 48,
64, ... max_num_seqs). Rows n..b are padding that writes nowhere that matters: the spare
token row R, position 0, slot -1 (its K/V would land in the null block 0; the kernels skip
it), context length 0 (the attention kernel reads no key and writes zeros) and temperature 0
(the sampler's greedy draw for them lands in row R, read only by padding). The step's inputs
live in one static buffer per device: the host fills a pinned copy with numpy (no per-token
Python), one H2D copy moves the used prefix, and the graphs of size b (or the eager step,
same shapes) read views of it. Token ids are not among them: each sequence's block-table row
names its slot in the runner's device buffer of next tokens, which the sampler writes, so a
step can be staged before the previous step's tokens reach the host.

Graphs are captured once, at engine start, largest first into one shared memory pool, and
only over memory whose addresses never move: the weights, KV and RoPE regions keep their
virtual addresses across sleep/wake (handoff.memory), and the pool and static buffers are
allocated outside every region, so a sleep unmaps none of them and nothing is recaptured.
A step is two replays: the model, then the LM head with the sampler (`rollout.graph_sampling`;
off, they run eagerly on the same static buffers). Everything here imports on CPU; only
`DecodeGraphs.capture` needs CUDA.

Shape legend: R = rows of the static buffers (max_num_seqs), B = rows of one step (padded),
M = blocks per sequence (the full block-table width), E = hidden size.
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence as Seq

import numpy as np
import torch

from handoff.errors import HandoffError
from handoff.rollout.sampling import SamplerRows, SamplingBatch

_ALIGN = 256  # bytes between fields of the staging buffer (Triton specializes on alignment)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The ladder: 1, 2, 4, 8, 16, 32, 48, ..., 128, then every 32, and max_num_seqs itself.

    Padding costs little (weights are read once per step whatever the rows; padded rows read
    no KV), so the steps widen where a few extra rows are cheapest.
    """
    assert max_num_seqs >= 1
    ladder = [1, 2, 4, 8] + list(range(16, 129, 16)) + list(range(160, max_num_seqs, 32))
    return sorted({s for s in ladder if s < max_num_seqs} | {max_num_seqs})


def bucket(num_rows: int, sizes: Seq[int]) -> int | None:
    """The smallest ladder size holding `num_rows` rows (None: larger than every size)."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


class DecodeInputs:
    """Static decode inputs: a pinned host staging buffer and its device twin, one copy a step.

    Layout (bytes, each field 256-aligned): rows, positions, slot_mapping (int64 [R]),
    context_lens and order (int32 [R]: with `longest_first`, the rows longest context first,
    the order attention starts their programs in), the sampler's temperature, top_p (float32
    [R]), top_k (int64 [R]) and uniform (float64 [R]), block_tables (int32 [R, M]) last, so a
    step of B rows moves one contiguous prefix: the small fields whole and B table rows.
    Columns of a block-table row past what its context needs keep stale values: the kernel
    reads only blocks below context_len, so they are never used.
    On CPU the host buffer is the device buffer and `upload` copies nothing.
    """

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device,
                 *, longest_first: bool = False):
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.device = device
        self.longest_first = longest_first   # stage `order` (else views give None)
        fields = [("rows", 8, max_rows), ("pos", 8, max_rows), ("slots", 8, max_rows),
                  ("ctx", 4, max_rows), ("order", 4, max_rows), ("temp", 4, max_rows),
                  ("top_p", 4, max_rows), ("top_k", 8, max_rows), ("uniform", 8, max_rows),
                  ("tables", 4, max_rows * max_blocks)]
        offsets, end = {}, 0
        for name, size, count in fields:
            end = -(-end // _ALIGN) * _ALIGN
            offsets[name] = (end, end + size * count)
            end += size * count
        self._table_start = offsets["tables"][0]
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(end, dtype=torch.uint8, pin_memory=on_cuda)
        self.dev = torch.zeros(end, dtype=torch.uint8, device=device) if on_cuda else self.host
        raw = self.host.numpy()
        np_types = {"rows": np.int64, "pos": np.int64, "slots": np.int64, "ctx": np.int32,
                    "order": np.int32,
                    "temp": np.float32, "top_p": np.float32, "top_k": np.int64,
                    "uniform": np.float64, "tables": np.int32}
        torch_types = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32,
                       np.float64: torch.float64}
        self.h = {k: raw[a:b].view(np_types[k]) for k, (a, b) in offsets.items()}
        self.h["tables"] = self.h["tables"].reshape(max_rows, max_blocks)
        self.d = {k: self.dev[a:b].view(torch_types[np_types[k]]) for k, (a, b) in offsets.items()}
        self.d["tables"] = self.d["tables"].view(max_rows, max_blocks)
        # The staging buffer is rewritten each step: wait until the last copy has read it.
        self._copied = torch.cuda.Event() if on_cuda else None

    def fill(self, rows: np.ndarray, lens: np.ndarray, tables: np.ndarray,
             padded_rows: int) -> int:
        """Stage a step: sequences' block-table rows and lengths (incl. the new token).

        Rows len(rows)..padded_rows become padding (row index max_rows: the spare token
        row). Returns the block-table width the real rows need (columns past it may hold
        stale values).
        """
        n, bs = len(rows), self.block_size
        assert 0 < n <= padded_rows <= self.max_rows, (n, padded_rows, self.max_rows)
        if self._copied is not None:
            self._copied.synchronize()
        width = -(-int(lens.max()) // bs)
        assert width <= self.max_blocks, (width, self.max_blocks)
        h = self.h
        tables_nw = tables[rows, :width]
        h["tables"][:n, :width] = tables_nw
        positions = lens - 1
        h["rows"][:n] = rows
        h["pos"][:n] = positions
        h["ctx"][:n] = lens
        h["slots"][:n] = tables_nw[np.arange(n), positions // bs].astype(np.int64) * bs \
            + positions % bs
        h["rows"][n:padded_rows] = self.max_rows
        h["pos"][n:padded_rows] = 0
        h["ctx"][n:padded_rows] = 0
        h["slots"][n:padded_rows] = -1
        if self.longest_first:   # attention starts long rows first, so their tails overlap
            # the short ones (kernels/paged_decode.py); padding (context 0) last
            h["order"][:padded_rows] = np.argsort(-h["ctx"][:padded_rows], kind="stable")
        return width

    def fill_sampling(self, batch: SamplingBatch, padded_rows: int) -> None:
        """Stage the step's sampling inputs; padding rows draw greedily (their tokens land in
        the spare row, which only padding rows read)."""
        n, h = len(batch.temperature), self.h
        for name, values, pad in (("temp", batch.temperature, 0.0), ("top_p", batch.top_p, 1.0),
                                  ("top_k", batch.top_k, 0), ("uniform", batch.uniform, 0.0)):
            h[name][:n] = values
            h[name][n:padded_rows] = pad

    def upload(self, rows: int) -> None:
        """Copy the staged first `rows` rows of every field to the device (one copy)."""
        if self._copied is None:
            return
        nbytes = self._table_start + rows * self.max_blocks * 4
        self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))

    def sampler_rows(self, lo: int, hi: int, mode: str) -> SamplerRows | None:
        """The staged sampling inputs of rows [lo, hi) as `draw` reads them in `mode`
        (sampling.sampling_mode; greedy: None)."""
        if mode == "greedy":
            return None
        d, truncate = self.d, mode == "truncate"
        return SamplerRows(temperature_B=d["temp"][lo:hi], uniform_B=d["uniform"][lo:hi],
                           top_k_B=d["top_k"][lo:hi] if truncate else None,
                           top_p_B=d["top_p"][lo:hi] if truncate else None)

    def views(self, rows: int, width: int) -> tuple[torch.Tensor, ...]:
        """(block-table rows, positions, block_tables [rows, width], context_lens,
        slot_mapping, order or None)."""
        d = self.d
        return (d["rows"][:rows], d["pos"][:rows], d["tables"][:rows, :width], d["ctx"][:rows],
                d["slots"][:rows], d["order"][:rows] if self.longest_first else None)


class DecodeGraphs:
    """CUDA graphs captured once into one pool, keyed by (ladder size, part); counts them.

    The parts of a decode step: "model" (the forward, into the runner's hidden states) and,
    with rollout.graph_sampling, "greedy", "sample" and "truncate" (the LM head and the
    sampler, one per sampling mode, into the runner's tokens and log-probs).
    """

    def __init__(self, sizes: Seq[int]):
        self.sizes = list(sizes)
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.num_captures = 0
        self.pool_bytes = 0    # growth of torch's reserved memory during capture
        self.driver_bytes = 0  # drop of the driver's free memory (adds graph instantiation)

    def capture(self, steps: dict[tuple[int, str], Callable[[], None]],
                device: torch.device) -> None:
        """Capture every step (largest size first), each a function that writes its results
        into buffers allocated outside the graphs.

        A step must read only static inputs (views of fixed buffers) so a replay after
        refilling them computes the new step; nothing it allocates outlives it, so the graphs
        share one pool and replay in any order. Each step first runs eagerly on the capture
        stream: Triton compiles and cuBLAS sets up there, never inside a capture.
        """
        assert not self.graphs, "decode graphs are captured once per engine"
        order = sorted(steps, key=lambda key: (-key[0], key[1]))
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for key in order:
                steps[key]()
        stream.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device)
        free = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        for key in order:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    steps[key]()
            except RuntimeError as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                fix = ("rollout.graph_sampling=false to sample outside the graphs"
                       if key[1] != "model" else "rollout.cuda_graphs=false to decode eagerly")
                raise HandoffError(f"capturing the decode graph {key[1]!r} of batch {key[0]} "
                                   f"failed ({first}): set {fix}, and report it") from e
            self.graphs[key] = graph
            self.num_captures += 1
        torch.cuda.synchronize(device)
        self.pool_bytes = max(torch.cuda.memory_reserved(device) - reserved, 0)
        self.driver_bytes = max(free - torch.cuda.mem_get_info(device)[0], 0)

    def has(self, batch: int, part: str) -> bool:
        return (batch, part) in self.graphs

    def replay(self, batch: int, part: str = "model") -> None:
        self.graphs[batch, part].replay()
