"""Runs the model for one scheduled step: builds the packed inputs, forwards, samples.

Prefill packs the uncached tail of each admitted sequence into one flat batch (its index
arrays go to the device in one copy); on CUDA each layer attends with one varlen_attn call
(attention.PackedPrefill), elsewhere with the per-sequence reference loop. Decode stages its
inputs and its sampling inputs in graphs.DecodeInputs (numpy, one H2D copy). On CUDA with the
Triton kernel the batch is padded to a ladder size and that size's captured graphs replay
(graphs.py): the model, then the LM head and the sampler (`graph_sampling`); with them off
the same padded shapes run eagerly, so all compute the same numbers. On CPU decode runs
eagerly at the exact batch. The sampler writes each sequence's token into `next_ids` at its
block-table row, where the next decode step reads its input ids: a step can be launched
before the previous one's tokens reach the host (`launch`, then `collect`; `ahead=1` stages a
decode for the token in flight). `collect` copies tokens
and log-probs to the host once and waits once (`wait_seconds`), so the engine can tell the
host's own time per step from the device's.

Shape legend: T = tokens, L = context keys, B = sequences, M = blocks per sequence,
V = vocabulary, E = hidden size.
"""

from __future__ import annotations

import functools
import os
import time
import warnings

import numpy as np
import torch

from handoff.memory.allocator import expandable_segments
from handoff.memory.host_copy import results_to_host, upload
from handoff.rollout import ops
from handoff.rollout.attention import (FP8_DTYPE, AttnMeta, KVCache, PackedPrefill,
                                       packed_prefill_available, select_decode_backend)
from handoff.rollout.gemm_choice import (backends_for, choose_backends, gemm_backend,
                                         gpu_seconds, skinny_tuning_sizes)
from handoff.rollout.graphs import DecodeGraphs, DecodeInputs, bucket, graph_batch_sizes
from handoff.rollout.models.qwen3 import CausalLM
from handoff.rollout.sampling import (SamplerRows, SamplingBatch, draw, fused_draw_applies,
                                     sample, sampling_mode, uniforms)
from handoff.rollout.sequence import Sequence

SAMPLING_MODES = ("greedy", "sample", "truncate")   # sampling.sampling_mode's answers
_SAMPLER_ROWS = 32
PREFETCH_MAX_ROWS = 32   # above it the products stream their weights at the copy rate


class ModelRunner:
    """The model, its paged KV cache and the per-step tensor plumbing."""

    def __init__(self, model: CausalLM, *, device: torch.device, block_size: int,
                 kv_dtype: torch.dtype, attention_backend: str | None = None,
                 cuda_graphs: bool = False, graph_sampling: bool = True,
                 decode_gemm: str = "cublas", readback_by_kernel: bool = True):
        self.model = model
        self.spec = model.spec
        self.device = device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.backend, self.decode_fn = select_decode_backend(device, self.dtype,
                                                                 attention_backend)
        # Padded decode needs the Triton kernel: the reference path would gather the whole
        # table width for every padded row.
        self.pad_decode = device.type == "cuda" and self.backend == "triton"
        self.use_graphs = bool(cuda_graphs) and self.pad_decode
        # Decode attention starts the rows' programs longest context first, so a long row's
        # tail overlaps the short ones (kernels/paged_decode.py): the public workload's decode
        # 2.9% faster on an H100 (docs/PERF.md). HANDOFF_LONGEST_FIRST=0: row order.
        self.longest_first = os.environ.get("HANDOFF_LONGEST_FIRST", "1") != "0"
        # Each layer's next weights asked for in L2 on a side stream while its small kernels
        # run (kernels/prefetch.py), at <= PREFETCH_MAX_ROWS rows: HANDOFF_L2_PREFETCH names
        # the plan (e.g. o+gu16); unset or 0: off. Measured before it becomes a default.
        self.prefetch = _layer_prefetch(model, device, self.pad_decode)
        if cuda_graphs and device.type == "cuda" and not self.pad_decode:
            warnings.warn(f"rollout.cuda_graphs is ignored with the {self.backend!r} attention "
                          "backend (decode runs eagerly): use a bf16/fp16 model and the triton "
                          "backend to capture decode graphs", stacklevel=2)
        # The LM head and the sampler captured too: a decode step is two replays, not ~30
        # launches and the uploads of the sampling inputs (issue: the host's share per step).
        # Not under TP yet: the head's all_gather in a graph has no test on a card.
        single = model.tp.size == 1
        self.sample_in_graph = self.use_graphs and bool(graph_sampling) and single
        # The GEMM backend of each ladder size's decode step (gemm_choice.py): padded CUDA
        # decode only; "auto" times them at bind_tables (one process: TP ranks timing on
        # their own could choose apart and fall out of step, so TP keeps cuBLAS).
        self.decode_gemm = decode_gemm if single or decode_gemm != "auto" else "cublas"
        if self.decode_gemm == "triton" and self.pad_decode and not ops.fused_available():
            warnings.warn("rollout.decode_gemm=triton needs the Triton kernels (triton "
                          "installed, HANDOFF_FUSED not 0): decode runs cuBLAS", stacklevel=2)
            self.decode_gemm = "cublas"
        self.skinny_tune_seconds = 0.0   # the skinny kernel's tuning at start (gemm_choice.py)
        self.gemm_by_size: dict[int, str] = {}
        self.gemm_seconds: dict[int, dict[str, float]] = {}
        self.packed_prefill = packed_prefill_available(device, self.dtype)
        self.kv_storage: torch.Tensor | None = None  # [2, layers, N, S, K, D]
        self.decode_kv_tokens = 0   # K/V tokens read by every decode step so far
        self.kv_scales: torch.Tensor | None = None   # [2, layers] fp32, fp8 only
        self.kv: KVCache | None = None
        self.tables: np.ndarray | None = None  # the block manager's [rows, M] array
        self.inputs: DecodeInputs | None = None
        self.sizes: list[int] = []             # the graph ladder (padded decode only)
        self.graphs: DecodeGraphs | None = None
        self.hidden_out: torch.Tensor | None = None  # [rows, E], written by the graphs
        self.next_ids: torch.Tensor | None = None  # int64 [rows + 1]: the next input token
        self.tokens_R: torch.Tensor | None = None  # a decode step's draws, int64 [rows]
        self.logprobs_R: torch.Tensor | None = None  # and their log-probs, float32 [rows]
        self._host_results: list | None = None      # two (tokens, logprobs) pairs, pinned on CUDA
        # Results to the host by a kernel: a copy would queue behind the trainer's state
        # going to the host under generation (handoff.memory.host_copy).
        self.readback_by_kernel = readback_by_kernel
        self._launches = 0
        self.wait_seconds = 0.0  # host time spent waiting for the device's results

    # ---------------------------------------------------------------- the KV pool

    def kv_block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        s = self.spec
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[K|V, layer, block, token, KV head, dim]: each layer's K (or V) one slab."""
        s = self.spec
        return (2, s.num_layers, num_blocks, self.block_size, s.num_kv_heads, s.head_dim)

    def allocate_kv_cache(self, num_blocks: int, storage: torch.Tensor | None = None
                          ) -> list[torch.Tensor]:
        """Allocate the pool (zeroed), or adopt `storage` (an elastic region's view of
        kv_shape(num_blocks)); returns the tensors to track in the kv_cache region."""
        s = self.spec
        self.kv_storage = (storage if storage is not None else
                           torch.zeros(self.kv_shape(num_blocks), dtype=self.kv_dtype,
                                       device=self.device))
        tensors = [self.kv_storage]
        if self.kv_dtype == FP8_DTYPE:
            self.kv_scales = torch.ones(2, s.num_layers, dtype=torch.float32, device=self.device)
            tensors.append(self.kv_scales)
        self._bind_kv()
        return tensors

    def _bind_kv(self) -> None:
        layers = range(self.spec.num_layers)
        scales = self.kv_scales
        self.kv = KVCache(k=[self.kv_storage[0, i] for i in layers],
                          v=[self.kv_storage[1, i] for i in layers],
                          k_scale=None if scales is None else [scales[0, i] for i in layers],
                          v_scale=None if scales is None else [scales[1, i] for i in layers])

    def reset_kv_cache(self, start: int = 0, stop: int | None = None) -> None:
        """After the pool's blocks [start, stop) are mapped (all of a fixed pool; an elastic
        pool's mapped front at a wake, or the blocks a growth added): fp8 blocks zeroed, and
        from start 0 the scales back to 1 (the source).

        A bf16 pool on CUDA is not zeroed (a write pass over the whole pool, 116 GB in the
        4B run, every step, for nothing): every attention path reads only below each
        sequence's context length. CPU pools are zeroed (cheap, and a freshly re-grown CPU
        storage may hold any bit pattern).
        """
        if self.kv_scales is not None or self.kv_storage.device.type != "cuda":
            self.kv_storage[:, :, start:stop].view(torch.uint8).zero_()
        if self.kv_scales is not None and start == 0:
            self.kv_scales.fill_(1.0)

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_storage is None else self.kv_storage.numel() * self.kv_storage.element_size()

    # ---------------------------------------------------------------- decode setup

    def bind_tables(self, tables: np.ndarray) -> None:
        """Read block tables from the block manager's [rows, M] array; set up decode.

        Allocates the static decode inputs and, on CUDA with graphs on, captures the ladder.
        Call it outside every memory region, after the KV pool exists: the graphs point into
        the pool, and their own memory must stay resident when the regions sleep.
        """
        self.tables = tables
        max_rows, max_blocks = tables.shape
        self.inputs = DecodeInputs(max_rows, max_blocks, self.block_size, self.device,
                                   longest_first=self.longest_first)
        self.sizes = graph_batch_sizes(max_rows) if self.pad_decode else []
        # Row max_rows is the padding rows' token (their own greedy draws land there, any id
        # in the vocabulary). Allocated outside every region.
        self.next_ids = torch.zeros(max_rows + 1, dtype=torch.int64, device=self.device)
        self.tokens_R = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self.logprobs_R = torch.zeros(max_rows, dtype=torch.float32, device=self.device)
        # Two in flight at most (a step and the one staged ahead of its tokens).
        pin = self.device.type == "cuda"
        self._host_results = [(torch.empty(max_rows, dtype=torch.int64, pin_memory=pin),
                               torch.empty(max_rows, dtype=torch.float32, pin_memory=pin))
                              for _ in range(2)]
        if self.pad_decode:
            self._choose_gemm_libraries()
        if self.use_graphs:
            assert self.kv is not None, "allocate the KV cache before capturing decode graphs"
            self.hidden_out = torch.empty(max_rows, self.spec.hidden_size, dtype=self.dtype,
                                          device=self.device)
            self.graphs = DecodeGraphs(self.sizes)
            steps = {(b, "model"): functools.partial(self._model_step, b) for b in self.sizes}
            if self.sample_in_graph:
                steps.update({(b, mode): functools.partial(self._sample_step,
                                                           self.hidden_out, b, mode)
                              for b in self.sizes for mode in SAMPLING_MODES})
            # Plain segments for the graph pool: it is resident, never grown after capture.
            with torch.inference_mode(), expandable_segments(False):
                self.graphs.capture(steps, self.device)

    def _choose_gemm_libraries(self) -> None:
        """Each ladder size's GEMM backend: the one named by decode_gemm, or with "auto" the
        fastest whole decode step (device time, gemm_choice.gpu_seconds). The skinny kernel,
        where it may run, is tuned first."""
        skinny = ops.fused_available()
        if skinny and self.decode_gemm in ("triton", "auto"):
            self._tune_skinny()
        if self.decode_gemm != "auto":
            self.gemm_by_size = dict.fromkeys(self.sizes, self.decode_gemm)
            return

        def time_step(rows: int, backend: str) -> float:
            def step() -> None:
                with gemm_backend(backend):
                    self._sample_step(self._forward_decode(rows, self.inputs.max_blocks),
                                      rows, "sample")
            return gpu_seconds(step, self.device)

        with torch.inference_mode():
            self.gemm_by_size, self.gemm_seconds = choose_backends(
                self.sizes, time_step, functools.partial(backends_for, skinny=skinny))
        torch.cuda.empty_cache()   # what the timed steps cached: nothing stays reserved

    def _tune_skinny(self) -> None:
        """The skinny kernel's configs chosen now for every shape a decode step gives it
        (each linear and the LM head, at each padded row count), so that no step tunes:
        tuning compiles and times eight configs a shape, seconds inside a generate."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        with torch.inference_mode(), gemm_backend("triton"):
            for rows in skinny_tuning_sizes(self.sizes):
                self._sample_step(self._forward_decode(rows, self.inputs.max_blocks), rows,
                                  "sample")
        torch.cuda.synchronize(self.device)
        self.skinny_tune_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()

    def stats(self) -> dict:
        graphs = self.graphs
        return {"cuda_graphs": graphs is not None,
                "graph_captures": 0 if graphs is None else graphs.num_captures,
                "graph_pool_bytes": 0 if graphs is None else graphs.pool_bytes,
                "graph_driver_bytes": 0 if graphs is None else graphs.driver_bytes,
                "graph_batch_sizes": list(self.sizes), "graph_sampling": self.sample_in_graph,
                "decode_gemm": dict(self.gemm_by_size),
                "skinny_tune_s": self.skinny_tune_seconds,
                "decode_gemm_ms": {b: {lib: 1e3 * s for lib, s in t.items()}
                                   for b, t in self.gemm_seconds.items()},
                "packed_prefill": self.packed_prefill,
                "readback_by_kernel": self.readback_by_kernel}

    # ---------------------------------------------------------------- steps

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, *, ahead: int = 0):
        """Queue the step's forward and sampling and the copy of its results to the host;
        `collect` the returned handle. ahead=1: a decode step for the tokens the step in
        flight is sampling (each sequence one token longer than it knows)."""
        batch = self.sampling_batch(seqs, ahead)
        if is_prefill:
            logits_BV, rows_B = self._prefill(seqs)
            tokens_B, logprobs_B = sample(logits_BV, batch)
            self.next_ids[rows_B] = tokens_B
        else:
            tokens_B, logprobs_B = self._decode(seqs, ahead, batch)
        tokens, logprobs = (t[:len(seqs)] for t in self._host_results[self._launches % 2])
        self._launches += 1
        if self.device.type != "cuda":
            tokens.copy_(tokens_B)
            logprobs.copy_(logprobs_B)
            return tokens, logprobs, None
        if self.readback_by_kernel:
            results_to_host(tokens, logprobs, tokens_B, logprobs_B)
        else:
            tokens.copy_(tokens_B, non_blocking=True)
            logprobs.copy_(logprobs_B, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return tokens, logprobs, ready

    def collect(self, launched) -> tuple[list[int], list[float]]:
        """Wait for a launched step's results (timed: `wait_seconds`); (token ids, log-probs)."""
        tokens, logprobs, ready = launched
        if ready is not None:
            start = time.perf_counter()
            ready.synchronize()
            self.wait_seconds += time.perf_counter() - start
        return tokens.tolist(), logprobs.tolist()

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        bs, num = self.block_size, len(seqs)
        q_lens = np.fromiter((s.num_tokens - s.num_cached_tokens for s in seqs), np.int64, num)
        ctx_lens = np.fromiter((s.num_tokens for s in seqs), np.int64, num)
        input_ids: list[int] = []
        for seq in seqs:
            input_ids.extend(seq.token_ids[seq.num_cached_tokens:])
        ends = np.cumsum(q_lens)
        seq_of_token = np.repeat(np.arange(num), q_lens)
        positions = np.arange(ends[-1]) - np.repeat(ends - ctx_lens, q_lens)
        tables_BM = self.tables[[s.row for s in seqs], :-(-int(ctx_lens.max()) // bs)]
        slots = tables_BM[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        parts = [np.asarray(input_ids, np.int64), positions, slots, ends - 1,
                 np.fromiter((s.row for s in seqs), np.int64, num)]
        fresh = bool((q_lens == ctx_lens).all())
        if self.packed_prefill:
            key_ends = np.cumsum(ctx_lens)
            parts.append(np.concatenate([[0], ends, [0], key_ends]))
            if not (fresh and self.kv_dtype == self.dtype):
                seq_of_key = np.repeat(np.arange(num), ctx_lens)
                key_pos = np.arange(key_ends[-1]) - np.repeat(key_ends - ctx_lens, ctx_lens)
                parts.append(tables_BM[seq_of_key, key_pos // bs].astype(np.int64) * bs
                             + key_pos % bs)
        flat = self._dev(np.concatenate(parts))  # one host-to-device copy
        views = torch.split(flat, [len(p) for p in parts])
        ids_T, positions_T, slots_T, last_B, rows_B = views[:5]
        meta = AttnMeta(is_prefill=True, kv=self.kv, slot_mapping_T=slots_T,
                        query_lens=q_lens.tolist(), context_lens=ctx_lens.tolist())
        if self.packed_prefill:
            cu = views[5].to(torch.int32)
            meta.packed = PackedPrefill(
                key_slots_L=views[6] if len(views) > 6 else None, cu_q=cu[:num + 1],
                cu_k=cu[num + 1:], max_q=int(q_lens.max()), max_k=int(ctx_lens.max()),
                fresh=fresh)
        else:
            meta.block_tables_BM = self._dev(tables_BM)
        hidden_TE = self.model(ids_T, positions_T, meta)
        return self.model.compute_logits(hidden_TE[last_B]), rows_B

    def _decode(self, seqs: list[Sequence], ahead: int, batch: SamplingBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage, forward and sample a decode step; (tokens, log-probs) of its sequences."""
        num = len(seqs)
        rows = bucket(num, self.sizes) if self.pad_decode else num
        assert rows is not None, (num, self.sizes)
        table_rows, lens = decode_rows(seqs)
        # K/V tokens this step's attention reads (the HBM floor's share: engine.stats)
        self.decode_kv_tokens += int(lens.sum()) + num * ahead
        width = self.inputs.fill(table_rows, lens + ahead, self.tables, rows)
        self.inputs.fill_sampling(batch, rows)
        self.inputs.upload(rows)
        mode = sampling_mode(batch)
        if self.graphs is not None:
            self.graphs.replay(rows)
            hidden_BE = self.hidden_out
        else:
            # Padded decode runs at the graphs' full table width: the same shapes, same numbers.
            full = self.inputs.max_blocks if self.pad_decode else width
            with gemm_backend(self.gemm_by_size.get(rows)):
                hidden_BE = self._forward_decode(rows, full)
        if self.sample_in_graph:
            self.graphs.replay(rows, mode)
        else:
            self._sample_step(hidden_BE, rows, mode)
        return self.tokens_R[:num], self.logprobs_R[:num]

    def _model_step(self, rows: int) -> None:
        """The captured model step: hidden states of the first `rows` rows into hidden_out."""
        with gemm_backend(self.gemm_by_size.get(rows)):
            self.hidden_out[:rows].copy_(self._forward_decode(rows, self.inputs.max_blocks))

    def _sample_step(self, hidden_RE: torch.Tensor, rows: int, mode: str) -> None:
        """The LM head and the sampler over the first `rows` staged rows (padding included:
        the same shapes whether captured or not): draws into tokens_R, logprobs_R and each
        row's slot of next_ids. The sampler runs _SAMPLER_ROWS rows at a time, which bounds
        its float32/float64 [rows, V] temporaries (resident in the graph pool when captured);
        every sampler op works row by row, so the draws do not depend on the split. The
        one-kernel draw (sampled, no truncation, CUDA) has no such temporaries: one launch."""
        with gemm_backend(self.gemm_by_size.get(rows)):
            logits_BV = self.model.compute_logits(hidden_RE[:rows])
        one_kernel = mode == "sample" and fused_draw_applies(logits_BV, truncate=False)
        chunk = rows if one_kernel else _SAMPLER_ROWS
        for lo in range(0, rows, chunk):
            hi = min(lo + chunk, rows)
            tokens_B, logprobs_B = draw(logits_BV[lo:hi], self.inputs.sampler_rows(lo, hi, mode),
                                        truncate=mode == "truncate", fused=one_kernel)
            self.tokens_R[lo:hi] = tokens_B
            self.logprobs_R[lo:hi] = logprobs_B
        self.next_ids[self.inputs.d["rows"][:rows]] = self.tokens_R[:rows]

    def _forward_decode(self, rows: int, width: int) -> torch.Tensor:
        """The model over the first `rows` staged decode rows -> hidden states [rows, E]."""
        rows_B, positions_B, tables_BM, context_lens_B, slots_B, order_B = \
            self.inputs.views(rows, width)
        ids_B = self.next_ids[rows_B]
        meta = AttnMeta(is_prefill=False, kv=self.kv, slot_mapping_T=slots_B,
                        block_tables_BM=tables_BM, context_lens_B=context_lens_B,
                        decode_fn=self.decode_fn, order_B=order_B,
                        prefetch=self.prefetch if rows <= PREFETCH_MAX_ROWS else None)
        return self.model(ids_B, positions_B, meta)

    @staticmethod
    def sampling_batch(seqs: list[Sequence], ahead: int = 0) -> SamplingBatch:
        num = len(seqs)
        keys = np.fromiter((s.key for s in seqs), np.uint64, num)
        steps = np.fromiter((s.num_tokens - s.num_prompt_tokens + ahead for s in seqs),
                            np.uint64, num)
        return SamplingBatch(
            temperature=np.fromiter((s.params.temperature for s in seqs), np.float32, num),
            top_p=np.fromiter((s.params.top_p for s in seqs), np.float32, num),
            top_k=np.fromiter((s.params.top_k for s in seqs), np.int64, num),
            uniform=uniforms(keys, steps))

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return upload(array, self.device)

    # ---------------------------------------------------------------- sizing

    @torch.inference_mode()
    def profile_peak_bytes(self, *, max_num_batched_tokens: int, max_model_len: int,
                           max_num_seqs: int) -> int:
        """CUDA: bytes the worst-case step allocates above the weights (prefill + sampling)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        seq_len = min(max_model_len, max_num_batched_tokens)
        num_seqs = max(1, min(max_num_batched_tokens // seq_len, max_num_seqs))
        input_ids = torch.zeros(num_seqs * seq_len, dtype=torch.int64, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        meta = AttnMeta(is_prefill=True, kv=None, query_lens=[seq_len] * num_seqs)
        hidden = self.model(input_ids, positions, meta)
        del hidden
        rows = max_num_seqs
        logits = torch.randn(rows, self.spec.vocab_size, device=self.device, dtype=self.dtype)
        worst = SamplingBatch(temperature=np.ones(rows, np.float32),
                              top_p=np.full(rows, 0.9, np.float32), top_k=np.zeros(rows, np.int64),
                              uniform=np.full(rows, 0.5))
        sample(logits, worst)
        del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        s = self.spec
        per_key = 2 * s.num_kv_heads * s.head_dim * (
            self.dtype.itemsize + (4 if self.kv_dtype == FP8_DTYPE else 0))
        if self.backend == "torch":
            # The reference decode gathers every sequence's K and V (and an fp32 copy for fp8).
            peak += max_num_seqs * max_model_len * per_key
        if self.packed_prefill:
            # The packed prefill gathers each layer's context keys; the admission budget bounds
            # the new tokens, cached prefixes can add as much again.
            peak += 2 * max_num_batched_tokens * per_key
        torch.cuda.empty_cache()
        return int(peak)

    @torch.inference_mode()
    def graph_reserve_bytes(self, max_num_seqs: int) -> int:
        """CUDA: room to keep for the decode graphs' pool, before the KV pool exists.

        The pool holds what the largest graph allocates (smaller ones reuse it): twice the peak
        of a cache-less forward of `max_num_seqs` tokens and, with graph_sampling, the LM head
        and the sampler's truncating draw after it, for the allocator's segment rounding, plus
        64 MiB. The capture then measures the real size (stats' graph_pool_bytes).
        """
        if not self.use_graphs:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        meta = AttnMeta(is_prefill=True, kv=None, query_lens=[max_num_seqs])
        hidden = self.model(ids, torch.zeros_like(ids), meta)
        if self.sample_in_graph:
            logits_BV = self.model.compute_logits(hidden)
            rows = min(max_num_seqs, _SAMPLER_ROWS)
            worst = SamplerRows(
                temperature_B=torch.ones(rows, device=self.device),
                uniform_B=torch.full((rows,), 0.5, dtype=torch.float64, device=self.device),
                top_k_B=torch.zeros(rows, dtype=torch.int64, device=self.device),
                top_p_B=torch.full((rows,), 0.9, device=self.device))
            draw(logits_BV[:rows], worst, truncate=True)
            del logits_BV
        del hidden
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return int(2 * peak + (64 << 20))


def _layer_prefetch(model: CausalLM, device: torch.device, padded: bool):
    """The L2 prefetch of HANDOFF_L2_PREFETCH's plan for padded CUDA decode on sm_90+, else
    None."""
    name = os.environ.get("HANDOFF_L2_PREFETCH", "0")
    if name in ("", "0"):
        return None
    from handoff.rollout.kernels.pdl import hopper
    from handoff.rollout.kernels.prefetch import LayerPrefetch, parse_plan
    plan = parse_plan(name)   # a bad plan is named on any device
    if not (padded and hopper(device)):
        return None
    weights = [(layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight,
                layer.self_attn.qkv_proj.weight) for layer in model.model.layers]
    return LayerPrefetch(weights, plan, torch.cuda.Stream(device))


def decode_rows(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """(block-table rows, lengths incl. the new token) of a decode batch."""
    num = len(seqs)
    return (np.fromiter((s.row for s in seqs), np.int64, num),
            np.fromiter((s.num_tokens for s in seqs), np.int64, num))
