"""Runs the model for one scheduled step: builds the packed inputs, forwards, samples.

Prefill packs the uncached tail of each admitted sequence into one flat batch. Decode is
`decode(input_ids, positions, block_tables, context_lens, slot_mapping) -> logits`: tensors
of fixed rank whose shapes depend only on (batch, block-table width), read from the block
manager's table array with one numpy slice, so a later version can pad them to a bucket and
replay a captured CUDA graph. Sampling and the one host sync (`tolist`) come after.

Shape legend: T = tokens, B = sequences, M = blocks per sequence, V = vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from handoff.rollout.attention import FP8_DTYPE, AttnMeta, KVCache, select_decode_backend
from handoff.rollout.models.qwen3 import CausalLM
from handoff.rollout.sampling import SamplingBatch, sample, uniforms
from handoff.rollout.sequence import Sequence


class ModelRunner:
    """The model, its paged KV cache and the per-step tensor plumbing."""

    def __init__(self, model: CausalLM, *, device: torch.device, block_size: int,
                 kv_dtype: torch.dtype, attention_backend: str | None = None):
        self.model = model
        self.spec = model.spec
        self.device = device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.backend, self.decode_fn = select_decode_backend(device, self.dtype,
                                                                 attention_backend)
        self.kv_storage: torch.Tensor | None = None  # [2, layers, N, S, K, D]
        self.kv_scales: torch.Tensor | None = None   # [2, layers] fp32, fp8 only
        self.kv: KVCache | None = None
        self.tables: np.ndarray | None = None  # the block manager's [rows, M] array

    # ---------------------------------------------------------------- the KV pool

    def kv_block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        s = self.spec
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        """Allocate the pool (zeroed); returns the tensors to track in the kv_cache region."""
        s = self.spec
        self.kv_storage = torch.zeros(2, s.num_layers, num_blocks, self.block_size,
                                      s.num_kv_heads, s.head_dim, dtype=self.kv_dtype,
                                      device=self.device)
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

    def reset_kv_cache(self) -> None:
        """Zero every block and set fp8 scales back to 1 (after the pool's memory is remapped)."""
        self.kv_storage.view(torch.uint8).zero_()
        if self.kv_scales is not None:
            self.kv_scales.fill_(1.0)

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_storage is None else self.kv_storage.numel() * self.kv_storage.element_size()

    # ---------------------------------------------------------------- steps

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> tuple[list[int], list[float]]:
        """Forward the step, sample a token per sequence; returns (token ids, log-probs)."""
        logits_BV = self._prefill(seqs) if is_prefill else self.decode(*self.prepare_decode(seqs))
        tokens_B, logprobs_B = sample(logits_BV, self.sampling_batch(seqs))
        return tokens_B.tolist(), logprobs_B.tolist()

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        bs = self.block_size
        input_ids: list[int] = []
        query_lens, context_lens = [], []
        for seq in seqs:
            input_ids.extend(seq.token_ids[seq.num_cached_tokens:])
            query_lens.append(seq.num_tokens - seq.num_cached_tokens)
            context_lens.append(seq.num_tokens)
        q_lens, ctx_lens = np.array(query_lens), np.array(context_lens)
        ends = np.cumsum(q_lens)
        seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(ends[-1]) - np.repeat(ends - q_lens, q_lens) \
            + np.repeat(ctx_lens - q_lens, q_lens)
        width = -(-int(ctx_lens.max()) // bs)
        tables_BM = self.tables[[s.row for s in seqs], :width]
        slots = tables_BM[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        meta = AttnMeta(is_prefill=True, kv=self.kv, slot_mapping_T=self._dev(slots),
                        block_tables_BM=self._dev(tables_BM), query_lens=query_lens,
                        context_lens=context_lens)
        hidden_TE = self.model(self._dev(np.array(input_ids)), self._dev(positions), meta)
        return self.model.compute_logits(hidden_TE[self._dev(ends - 1)])

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, ...]:
        """(input_ids, positions, block_tables, context_lens, slot_mapping) for `decode`."""
        return decode_inputs(seqs, self.tables, self.block_size, self.device)

    def decode(self, input_ids_B: torch.Tensor, positions_B: torch.Tensor,
               block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor,
               slot_mapping_B: torch.Tensor) -> torch.Tensor:
        """One token per sequence through the model; logits [B, V]."""
        meta = AttnMeta(is_prefill=False, kv=self.kv, slot_mapping_T=slot_mapping_B,
                        block_tables_BM=block_tables_BM, context_lens_B=context_lens_B,
                        decode_fn=self.decode_fn)
        return self.model.compute_logits(self.model(input_ids_B, positions_B, meta))

    @staticmethod
    def sampling_batch(seqs: list[Sequence]) -> SamplingBatch:
        num = len(seqs)
        keys = np.fromiter((s.key for s in seqs), np.uint64, num)
        steps = np.fromiter((s.num_tokens - s.num_prompt_tokens for s in seqs), np.uint64, num)
        return SamplingBatch(
            temperature=np.fromiter((s.params.temperature for s in seqs), np.float32, num),
            top_p=np.fromiter((s.params.top_p for s in seqs), np.float32, num),
            top_k=np.fromiter((s.params.top_k for s in seqs), np.int64, num),
            uniform=uniforms(keys, steps))

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return _to_device(array, self.device)

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
        if self.backend == "torch":
            # The reference decode gathers every sequence's K and V (and an fp32 copy for fp8).
            s = self.spec
            gather = 2 * max_num_seqs * max_model_len * s.num_kv_heads * s.head_dim
            peak += gather * (self.dtype.itemsize + (4 if self.kv_dtype == FP8_DTYPE else 0))
        torch.cuda.empty_cache()
        return int(peak)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def decode_inputs(seqs: list[Sequence], tables: np.ndarray, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """Decode-step tensors from the block manager's table array: a few numpy ops per step."""
    num = len(seqs)
    rows = np.fromiter((s.row for s in seqs), np.int64, num)
    lens = np.fromiter((s.num_tokens for s in seqs), np.int64, num)
    last = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, num)
    tables_BM = tables[rows, :-(-int(lens.max()) // block_size)]
    positions = lens - 1
    slots = (tables_BM[np.arange(num), positions // block_size].astype(np.int64) * block_size
             + positions % block_size)
    return tuple(_to_device(a, device) for a in (last, positions, tables_BM,
                                                 lens.astype(np.int32), slots))
