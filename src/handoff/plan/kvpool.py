"""The real tax of colocation: the KV pool that gpu_memory_utilization leaves the engine.

    pool = kv_pool_bytes(0.5, hw, weights)       # util x HBM - weights - activations - graphs
    rows = kv_table(shape, hw, tp=1, workload=wl, requested=0.5, best=0.85)

The engine sizes its KV pool once, at start: budget = util x HBM (capped at HBM minus what
no allocator ever gets back, the profile's `resident_bytes`), minus its weights, its
activation peak and its CUDA graph pool. Sleep and wake remap the same blocks, so the pool
never grows when the trainer frees memory. From the pool:

    concurrency c   = pool / ((P + L/2) x k_kv)        capped at max_num_seqs
    decode step     = (weights + KV in use) / effective HBM bandwidth
    tokens/s/card   = c / step / TP
    generation time = tokens per card / tokens/s  +  (L_max - L) x weights / bandwidth

The last term is the long tail: when the bulk of the responses is done, the longest one
still decodes L_max - L tokens almost alone, at the step time of reading the weights.

With the responses' lengths known (`Workload.lengths`: rollout.response_lengths' quantiles),
generation is simulated decode step by decode step instead (`decode_timeline`: admission,
the prompt's KV shared by its samples, preemption when the pool is full, the engine's
measured step floor): a long-tailed step's time is the sum of many small steps, which the
mean-concurrency formula above does not see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from handoff.plan.hardware import GB, HardwareProfile
from handoff.plan.shapes import ModelShape

UTILIZATIONS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 1.0)


@dataclass(frozen=True)
class Workload:
    """What one step asks of the engine on each card."""

    prompt_len: int
    response_len: int
    tokens_per_card: float                # generated tokens per card per step
    max_response_len: int | None = None   # the long tail (None: not modelled)
    max_num_seqs: int = 256               # the engine's batch cap
    lengths: tuple[int, ...] | None = None  # a card's responses' lengths (None: mean + tail)
    group_size: int = 1                   # samples per prompt, sharing its KV (simulation)

    @property
    def mean_context(self) -> float:
        """Average tokens cached per running sequence: P + L/2."""
        return self.prompt_len + self.response_len / 2


@dataclass(frozen=True)
class KvRow:
    """The engine at one gpu_memory_utilization."""

    utilization: float
    kv_pool_bytes: float
    concurrency: float
    decode_step_seconds: float
    tokens_per_second: float           # per card
    generation_seconds: float | None   # None when the pool holds no sequence
    tail_seconds: float
    requested: bool = False
    best: bool = False

    def to_dict(self) -> dict:
        return {"utilization": self.utilization, "kv_pool_bytes": int(self.kv_pool_bytes),
                "concurrency": self.concurrency, "decode_step_seconds": self.decode_step_seconds,
                "tokens_per_second": self.tokens_per_second,
                "generation_seconds": self.generation_seconds, "tail_seconds": self.tail_seconds,
                "requested": self.requested, "best": self.best}


def engine_weight_bytes(shape: ModelShape, tp: int, weight_bytes: int = 2) -> int:
    """Bytes of the engine's weights on one card (its TP shard)."""
    return math.ceil(shape.num_params * weight_bytes / tp)


def kv_bytes_per_token_per_card(shape: ModelShape, tp: int, kv_bytes: int = 2) -> float:
    """KV bytes one token costs on one card: heads split by TP (replicated past the KV-head
    count); an MLA latent is not split, every rank caches it whole."""
    if shape.kv_latent_dim:
        return float(shape.num_layers * shape.kv_latent_dim * kv_bytes)
    heads_per_card = max(shape.num_kv_heads / tp, 1.0)
    return 2 * shape.num_layers * heads_per_card * shape.head_dim * kv_bytes


def engine_budget_bytes(utilization: float, hw: HardwareProfile) -> float:
    """util x HBM, but never more than the card can hand the engine."""
    return min(utilization * hw.hbm_bytes, hw.hbm_bytes - hw.resident_bytes)


def kv_pool_bytes(utilization: float, hw: HardwareProfile, weights_bytes: float) -> float:
    """KV pool per card; negative when the weights and activations do not fit the budget."""
    return (engine_budget_bytes(utilization, hw) - weights_bytes - hw.activation_peak_bytes
            - hw.graph_pool_bytes)


def kv_shortfall(utilization: float, hw: HardwareProfile, weights_bytes: float) -> str | None:
    """Why the engine gets no KV pool at `utilization` (bytes named), or None when it gets one."""
    pool = kv_pool_bytes(utilization, hw, weights_bytes)
    if pool > 0:
        return None
    return (f"no KV pool at gpu_memory_utilization={utilization:g} ({-pool / GB:.1f} GB short): "
            f"engine weights need {weights_bytes / GB:.1f} GB + activations "
            f"{hw.activation_peak_bytes / GB:.1f} GB + CUDA graphs "
            f"{hw.graph_pool_bytes / GB:.1f} GB of "
            f"{engine_budget_bytes(utilization, hw) / GB:.1f} GB")


@dataclass(frozen=True)
class Timeline:
    """A simulated generation: seconds, decode steps, the most sequences run at once, the
    preemptions, and the seconds spent while fewer than half that many ran (the tail)."""

    seconds: float
    steps: int
    peak_running: int
    preemptions: int
    tail_seconds: float


@dataclass
class _Seq:
    length: int
    done: int = 0      # tokens generated before its current admission
    start: int = 0     # the step it was (re)admitted at

    def progress(self, step: int) -> int:
        return self.done + step - self.start


def decode_timeline(lengths: tuple[int, ...], *, prompt_len: int, pool_tokens: float,
                    max_num_seqs: int, weights_bytes: float, kv_per_token: float,
                    bw: float, group_size: int = 1, floor_s: float = 0.0,
                    per_seq_s: float = 0.0, kv_bw: float = 0.0) -> Timeline | None:
    """Decode `lengths` as the engine does; None when the pool cannot hold one sequence.

    Sequences are admitted first come first served while the batch cap allows and the pool
    holds their cached tokens plus one; the `group_size` samples of a prompt share its KV
    (the prefix cache), so each holds prompt_len / group_size of it. Every step adds a token
    to every running sequence; when the pool would overflow, the latest admitted sequence is
    preempted (freed, readmitted later with what it generated, as the engine recomputes it).
    A step costs max(floor_s, weights / bw) + per_seq_s per running sequence + reading every
    running sequence's whole context at kv_bw (the attention kernel's rate; 0: bw); each
    stretch between events is summed in closed form (the context grows by one token per
    sequence per step)."""
    fixed = max(floor_s, weights_bytes / bw)
    kv_bw = kv_bw or bw
    shared = prompt_len / group_size
    waiting = [_Seq(n) for n in reversed(lengths)]
    running: list[_Seq] = []
    step, seconds, tail, steps, peak, preempted = 0, 0.0, 0.0, 0, 0, 0
    full = False   # after a preemption, nothing is admitted until a sequence finishes
    while waiting or running:
        held = sum(shared + q.progress(step) for q in running)
        while (not full and waiting and len(running) < max_num_seqs
               and held + shared + waiting[-1].done + 1 <= pool_tokens):
            q = waiting.pop()
            q.start = step
            running.append(q)
            held += shared + q.done
        if not running:
            return None
        n = len(running)
        peak = max(peak, n)
        to_finish = min(q.length - q.progress(step) for q in running)
        to_full = int((pool_tokens - held) // n)   # steps before the pool overflows
        m = max(min(to_finish, to_full), 0)
        context = sum(prompt_len + q.progress(step) for q in running)
        stretch = m * (fixed + n * per_seq_s) + (m * context + n * m * (m - 1) / 2) * (
            kv_per_token / kv_bw)
        seconds += stretch
        tail += stretch if 2 * n < peak else 0.0
        steps += m
        step += m
        if m < to_finish:      # the pool is full: the latest admitted goes back to wait
            if n == 1:
                return None
            q = running.pop()
            q.done = q.progress(step)
            waiting.append(q)
            preempted += 1
            full = True
            continue
        full = False
        for q in [q for q in running if q.progress(step) >= q.length]:
            running.remove(q)
    return Timeline(seconds=seconds, steps=steps, peak_running=peak, preemptions=preempted,
                    tail_seconds=tail)


def kv_row(utilization: float, shape: ModelShape, hw: HardwareProfile, *, tp: int,
           workload: Workload, weight_bytes: int = 2, kv_bytes: int = 2,
           extra_weight_bytes: float = 0.0) -> KvRow:
    """Pool, concurrency, decode step, tokens/s and generation time at one utilization
    (extra_weight_bytes: held and read beside the weights each step, e.g. LoRA adapters)."""
    weights = engine_weight_bytes(shape, tp, weight_bytes) + extra_weight_bytes
    pool = kv_pool_bytes(utilization, hw, weights)
    per_token = kv_bytes_per_token_per_card(shape, tp, kv_bytes)
    if workload.lengths:
        return _simulated_row(utilization, pool, weights, per_token, hw, workload, tp)
    per_seq = workload.mean_context * per_token
    concurrency = min(max(pool, 0.0) / per_seq, float(workload.max_num_seqs))
    step = (weights + concurrency * per_seq) / hw.decode_bw_bps
    tokens_per_second = concurrency / step / tp
    longest = workload.max_response_len or workload.response_len
    tail = max(0, longest - workload.response_len) * weights / hw.decode_bw_bps
    generation = (workload.tokens_per_card / tokens_per_second + tail
                  if concurrency >= 1 else None)
    return KvRow(utilization=utilization, kv_pool_bytes=pool, concurrency=concurrency,
                 decode_step_seconds=step, tokens_per_second=tokens_per_second,
                 generation_seconds=generation, tail_seconds=tail)


def _simulated_row(utilization: float, pool: float, weights: float, per_token: float,
                   hw: HardwareProfile, workload: Workload, tp: int) -> KvRow:
    """kv_row from decode_timeline; an engine of TP t decodes the responses of t cards."""
    engine_lengths = tuple(n for n in workload.lengths for _ in range(tp))
    line = decode_timeline(engine_lengths, prompt_len=workload.prompt_len,
                           pool_tokens=max(pool, 0.0) / per_token,
                           max_num_seqs=workload.max_num_seqs, weights_bytes=weights,
                           kv_per_token=per_token, bw=hw.decode_bw_bps,
                           group_size=workload.group_size, floor_s=hw.decode_floor_s,
                           per_seq_s=hw.decode_per_seq_s, kv_bw=hw.kv_read_bps)
    if line is None:
        return KvRow(utilization=utilization, kv_pool_bytes=pool, concurrency=0.0,
                     decode_step_seconds=weights / hw.decode_bw_bps, tokens_per_second=0.0,
                     generation_seconds=None, tail_seconds=0.0)
    return KvRow(utilization=utilization, kv_pool_bytes=pool, concurrency=line.peak_running,
                 decode_step_seconds=line.seconds / line.steps,
                 tokens_per_second=sum(workload.lengths) / line.seconds,
                 generation_seconds=line.seconds, tail_seconds=line.tail_seconds)


def kv_table(shape: ModelShape, hw: HardwareProfile, *, tp: int, workload: Workload,
             requested: float, best: float | None = None, weight_bytes: int = 2,
             kv_bytes: int = 2, extra_weight_bytes: float = 0.0) -> list[KvRow]:
    """A row per utilization in UTILIZATIONS plus the requested and best ones, marked."""
    utils = sorted({*UTILIZATIONS, round(requested, 4), *([round(best, 4)] if best else [])})
    rows = []
    for u in utils:
        row = kv_row(u, shape, hw, tp=tp, workload=workload, weight_bytes=weight_bytes,
                     kv_bytes=kv_bytes, extra_weight_bytes=extra_weight_bytes)
        rows.append(KvRow(**{**row.__dict__, "requested": math.isclose(u, requested),
                             "best": best is not None and math.isclose(u, best)}))
    return rows


def generation_gain(rows: list[KvRow]) -> dict | None:
    """How much longer generation takes at the requested utilization than at the best one."""
    req = next((r for r in rows if r.requested), None)
    best = next((r for r in rows if r.best), None)
    if req is None or best is None or not req.generation_seconds or not best.generation_seconds:
        return None
    return {"from_utilization": req.utilization, "to_utilization": best.utilization,
            "seconds_saved": req.generation_seconds - best.generation_seconds,
            "slower_by": req.generation_seconds / best.generation_seconds - 1}
