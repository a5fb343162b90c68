"""The built-in rollout engine: generate, and hand the device back and forth.

    engine = Engine("ckpt/", cfg.rollout)                    # cfg: handoff.config.Config
    outs = engine.generate([[1, 2, 3]], SamplingParams(n=4, max_tokens=32))
    engine.sleep(2)                                          # weights + KV released
    engine.wake_up(["weights"]); engine.load_weights(trainer_named_tensors)
    engine.wake_up(["kv_cache"])                             # KV zeroed, prefix cache empty

One step is `scheduler.schedule()` -> `runner.launch()` -> `runner.collect()` ->
`scheduler.postprocess()`; in a run of decode steps the next one is launched before the
current one is collected (`step`). Memory lives in two `handoff.memory` regions:
"weights" (parameters, and the RoPE table, which a wake copies back from pinned host memory)
and "kv_cache" (the paged pool and fp8 scales). This module builds the engine and runs
generation; three parts of `Engine` live beside it: kv_pool.py (the KV pool's size, and an
elastic pool's growth), sleep_wake.py (sleep levels, wake_up, load_weights) and lora.py
(load_adapter, clear_adapter: LoRA applied beside the base, off unless asked for).

Tensor parallelism (`tp=N`, one process per rank, see parallel.py): each rank builds its
shard of the model and a KV pool for its own KV heads, loads its part of every full tensor,
and sleeps and wakes its own regions; every rank must make the same calls. Logits are
gathered in full, so all ranks sample the same tokens and return the same outputs.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from typing import Callable

import torch

from handoff.dist import with_index
from handoff.errors import HandoffError
from handoff.memory.elastic import SimulatedDevice
from handoff.memory.regions import RegionPool
from handoff.rollout.attention import FP8_DTYPE
from handoff.rollout.blocks import BlockManager
from handoff.rollout.kv_pool import EngineKVPool
from handoff.rollout.layers import inverse_frequencies, rope_table
from handoff.rollout.lora import EngineLora, LoraAdapters
from handoff.model_files import ModelFiles
from handoff.rollout.models import build_model, eos_token_ids, iter_checkpoint, spec_from_hf_config
from handoff.rollout.parallel import TPGroup, init_tp_group
from handoff.rollout.runner import ModelRunner
from handoff.rollout.sampling import SamplingParams, sample_key
from handoff.rollout.scheduler import Scheduler
from handoff.rollout.sequence import RequestOutput, SampleOutput, Sequence, Status
from handoff.rollout.sleep_wake import TAGS, EngineSleepWake

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise HandoffError(f"dtype {dtype!r} is not supported: use {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class Engine(EngineKVPool, EngineSleepWake, EngineLora):
    """Paged-KV generation engine for one device (see the module docstring)."""

    def __init__(self, model: str | ModelFiles, cfg, *, device=None, dtype=None, pool=None,
                 attention_backend: str | None = None, tp: TPGroup | int = 1,
                 simulated: SimulatedDevice | None = None, lora_max_rank: int | None = None):
        self.cfg = cfg
        files = ModelFiles.of(model)
        self.model_path = str(files.path)
        self.device = with_index(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _resolve_dtype(dtype, self.device)
        hf = files.config
        self.spec = spec_from_hf_config(hf)
        self.eos_token_ids = eos_token_ids(files)
        self.max_model_len = min(cfg.max_model_len, self.spec.max_position_embeddings)
        self.max_num_batched_tokens = max(self.max_model_len, 8192)
        self.pool = pool if pool is not None else RegionPool(self.device)
        self.tp = tp if isinstance(tp, TPGroup) else init_tp_group(tp)

        with self.pool.region("weights"):
            model = build_model(self.spec, device=self.device, dtype=self.dtype, tp=self.tp,
                                lora_max_rank=lora_max_rank)
        self.pool.track("weights", model)
        self.model = model
        self.weights_version = 0
        self._updating_weights = False
        self._missing_weights = model.weight_keys() - model.load_weights(iter_checkpoint(files))
        if self._missing_weights:
            raise HandoffError(f"checkpoint {self.model_path!r} lacks weights for "
                               f"{sorted(self._missing_weights)[:3]}: it does not match its "
                               "config.json (write it with save_pretrained)")

        # The RoPE table shares the weights' region: one map per wake, one unmap per sleep.
        # A level-2 sleep drops it with the weights; the wake copies it back from a pinned
        # table, a queued copy (it runs inside the timed weight sync, while the optimizer's
        # offload keeps the copy engines busy).
        table = rope_table(inverse_frequencies(hf, self.spec.head_dim), self.max_model_len)
        with self.pool.region("weights"):
            model.rope_cos_sin = table.to(self.device, copy=True)
        self.pool.track("weights", [model.rope_cos_sin])
        on_cuda = self.device.type == "cuda"
        table = table.pin_memory() if on_cuda else table
        self.pool.add_restore_hook(
            "weights", lambda: model.rope_cos_sin.copy_(table, non_blocking=on_cuda))

        # LoRA (lora.py): with a max rank, zero adapters exist before the KV pool is profiled
        # and the decode graphs captured; without, none until load_adapter (CPU, no graphs).
        self.lora = None if lora_max_rank is None else LoraAdapters(model, lora_max_rank)

        kv_dtype = FP8_DTYPE if cfg.kv_dtype == "fp8" else self.dtype
        self.runner = ModelRunner(model, device=self.device, block_size=cfg.block_size,
                                  kv_dtype=kv_dtype, attention_backend=attention_backend,
                                  cuda_graphs=cfg.cuda_graphs,
                                  graph_sampling=cfg.graph_sampling,
                                  decode_gemm=cfg.decode_gemm,
                                  readback_by_kernel=cfg.readback_by_kernel)
        self.activation_peak_bytes = 0  # profiled on CUDA when the pool is sized from util
        self.graph_reserve_bytes = 0    # kept free for the decode graphs (CUDA, from util)
        self.elastic = cfg.kv_pool == "elastic"
        if self.elastic:
            num_blocks = self._elastic_kv_cache(simulated)
        else:
            num_blocks = self._num_blocks()
            with self.pool.region("kv_cache"):
                kv_tensors = self.runner.allocate_kv_cache(num_blocks)
            self.pool.track("kv_cache", kv_tensors)
            self.pool.add_restore_hook("kv_cache", self.runner.reset_kv_cache)

        max_blocks_per_seq = -(-self.max_model_len // cfg.block_size)
        self.blocks = BlockManager(num_blocks, cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                                   max_blocks_per_seq=max_blocks_per_seq,
                                   usable=self._mapped_blocks() if self.elastic else None)
        # Outside every region: the decode graphs' pool must stay mapped while regions sleep.
        self.runner.bind_tables(self.blocks.tables)
        if self.elastic:
            # The graphs' pool is resident now: later maps keep only the activation peak free.
            self.pool.keep_free("kv_cache", self.activation_peak_bytes)
            self.pool.add_restore_hook("kv_cache", self._after_elastic_wake)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   max_model_len=self.max_model_len)
        self._paused = False
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(self.tp.shared_seed(self.device))  # same on TP ranks
        # decode_steps_staged: decode steps launched before the previous step's tokens
        # reached the host (the device had the next step queued while the host worked).
        self._counters = {"prefill_steps": 0, "decode_steps": 0, "decode_steps_staged": 0,
                          "generated_tokens": 0}
        self._decode_seconds = 0.0
        self._decode_wait_seconds = 0.0
        self._prefill_seconds = 0.0
        self.decoding = False   # generate: a decode step has been launched (its prefills are)

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 *, progress: bool = False,
                 between_steps: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Complete every prompt `params.n` times; outputs in prompt order, samples in order.

        `between_steps()` runs on the host after every engine step (the streamed switch lands
        the trainer's copies there and calls `grow_kv`); `decoding` says whether a decode
        step has been launched yet."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if self.tp.size > 1:  # ranks that diverge would wait in a collective forever
            state = (self._paused, [self.pool.is_awake(t) for t in TAGS],
                     bool(self._missing_weights))
            self.tp.check_same(repr((prompts, params, state)).encode(),
                               "generate requests or sleep states", self.device)
        self._check_ready()
        self._updating_weights = False
        if len(params) != len(prompts):
            raise HandoffError(f"{len(params)} SamplingParams for {len(prompts)} prompts: pass one, "
                               "or one per prompt")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            self._check_prompt(i, prompt)
            stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
            seed = p.seed if p.seed is not None else self._seed_rng.getrandbits(63)
            for j in range(p.n):
                seqs.append(Sequence(next(self._seq_ids), prompt, p, request_index=i,
                                     sample_index=j, key=sample_key(seed, j), stop_ids=stop))
        for seq in seqs:
            self.scheduler.add(seq)
        self.scheduler.peak_running = 0
        self.scheduler.blocks_short = False
        self.decoding = False
        bar = _progress_bar(len(seqs)) if progress else None
        try:
            staged = None
            while self.scheduler.has_work or staged is not None:
                finished, staged = self.step(staged)
                if between_steps is not None:
                    between_steps()
                if bar is not None:
                    bar.update(len(finished))
        except BaseException:
            self.scheduler.abort_all()
            self.blocks.reset_prefix_cache()  # hashes may name blocks that were never written
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [RequestOutput(prompt_token_ids=list(p)) for p in prompts]
        for seq in seqs:
            outputs[seq.request_index].outputs.append(SampleOutput(
                token_ids=seq.generated_token_ids, logprobs=seq.logprobs,
                finish_reason=seq.finish_reason))
        return outputs

    def step(self, staged=None) -> tuple[list[Sequence], tuple | None]:
        """Run one step; returns (the sequences that finished in it, the step staged next).

        `staged` is a decode step already launched (None: schedule one now). Before waiting
        for this step's tokens, the next decode step is launched when the scheduler can
        name its batch without them (reserve_ahead), so the device never waits for the
        host's postprocess and scheduling in between.
        """
        start, waited = time.perf_counter(), self.runner.wait_seconds
        if staged is None:
            seqs, is_prefill = self.scheduler.schedule()
            staged = (seqs, is_prefill, self.runner.launch(seqs, is_prefill))
        seqs, is_prefill, launched = staged
        ahead = None if is_prefill else self.scheduler.reserve_ahead()
        following = None
        self.decoding = self.decoding or not is_prefill
        if ahead is not None:
            following = (ahead, False, self.runner.launch(ahead, False, ahead=1))
            self._counters["decode_steps_staged"] += 1
        token_ids, logprobs = self.runner.collect(launched)
        self._counters["prefill_steps" if is_prefill else "decode_steps"] += 1
        self._counters["generated_tokens"] += sum(s.status is Status.RUNNING for s in seqs)
        finished = self.scheduler.postprocess(seqs, token_ids, logprobs)
        if is_prefill:
            self._prefill_seconds += time.perf_counter() - start
        else:
            self._decode_seconds += time.perf_counter() - start
            self._decode_wait_seconds += self.runner.wait_seconds - waited
        return finished, following

    def _check_prompt(self, index: int, prompt: list[int]) -> None:
        if not prompt:
            raise HandoffError(f"prompt {index} is empty: give at least one token id")
        if len(prompt) >= self.max_model_len:
            # Past the model's own context length, raising rollout.max_model_len changes nothing.
            limit = (f"{self.max_model_len} (the model's max_position_embeddings): shorten it"
                     if self.max_model_len < self.cfg.max_model_len
                     else f"{self.max_model_len}: shorten it or raise rollout.max_model_len")
            raise HandoffError(f"prompt {index} has {len(prompt)} tokens, max_model_len is {limit}")
        if min(prompt) < 0 or max(prompt) >= self.spec.vocab_size:
            raise HandoffError(f"prompt {index} holds token ids outside [0, {self.spec.vocab_size}): "
                               "tokenize with the model's own tokenizer")

    def _check_ready(self) -> None:
        asleep = [t for t in TAGS if not self.pool.is_awake(t)]
        if self._paused or asleep:
            raise HandoffError(f"the engine is asleep (paused={self._paused}, regions asleep: "
                               f"{asleep}): call wake_up() before generate")
        if self._missing_weights:
            raise HandoffError("the engine's weights were discarded by sleep(2) and not all were "
                               f"loaded again ({len(self._missing_weights)} missing): call "
                               "load_weights with the full model before generate")

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: all of this rank's, but an untied embedding
        (a lookup of one row per sequence, 0 here), and the adapter's A and B when it has one
        (at the maximum rank: its GEMMs read the zero padding too)."""
        adapter = 0 if self.lora is None else self.lora.nbytes
        return self._base_weight_bytes + adapter

    @functools.cached_property
    def _base_weight_bytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.model.lm_head is not None:
            emb = self.model.model.embed_tokens.weight
            total -= emb.numel() * emb.element_size()
        return total

    def stats(self) -> dict:
        b = self.blocks
        steps = max(self._counters["decode_steps"], 1)
        return {
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "tp_size": self.tp.size, "tp_rank": self.tp.rank,
            "attention_backend": self.runner.backend, "num_blocks": b.num_blocks,
            "block_size": b.block_size, "kv_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "kv_block_bytes": self.runner.kv_block_bytes(),
            "kv_cache_bytes": self.runner.kv_cache_bytes, "kv_pool": self.cfg.kv_pool,
            "kv_mapped_bytes": self.kv_mapped_bytes, "usable_blocks": b.usable,
            "activation_peak_bytes": self.activation_peak_bytes,
            "graph_reserve_bytes": self.graph_reserve_bytes, **self.runner.stats(),
            "decode_seconds": self._decode_seconds,
            "decode_wait_seconds": self._decode_wait_seconds,
            # What the decode steps read at the least: the weights each step, every running
            # sequence's K/V once (its HBM floor is this over the card's copy rate).
            "decode_read_bytes": (self._counters["decode_steps"] * self.decode_weight_bytes
                                  + self.runner.decode_kv_tokens
                                  * (self.runner.kv_block_bytes() // b.block_size)),
            "prefill_seconds": self._prefill_seconds,
            # Decode step wall time, and the part of it the host spends not waiting for the
            # device (scheduling, inputs, launches, postprocess).
            "decode_ms_per_step": 1e3 * self._decode_seconds / steps,
            "host_ms_per_step": 1e3 * (self._decode_seconds - self._decode_wait_seconds) / steps,
            "free_blocks": b.num_free_blocks, "cached_free_blocks": b.num_cached_free_blocks,
            "prefix_cache_queries": b.prefix_queries, "prefix_cache_hits": b.prefix_hits,
            "prefix_cache_hit_rate": b.prefix_hits / max(b.prefix_queries, 1),
            "preemptions": self.scheduler.num_preemptions,
            "peak_running": self.scheduler.peak_running, **self._counters,
            "max_num_seqs": self.cfg.max_num_seqs, "max_model_len": self.max_model_len,
            "weights_version": self.weights_version, "paused": self._paused,
            "awake": {t: self.pool.is_awake(t) for t in TAGS},
        }


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="sample")
