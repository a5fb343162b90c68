"""An HF causal LM sharded with FSDP2: per-token log-probs, full params, offload of its parts.

    ref = ShardedModel("/ckpt", role="ref", device="cuda", dtype="bfloat16", arena=arena)
    logp_BT, entropy_BT = ref.log_probs(batch)
    ref.to("host", params=True).wait()      # {"params": {"bytes": ..., "seconds": ...}}
    ref.to("host", params=True, copy=False) # later offloads of a frozen model: no copy

The reference model is a ShardedModel; the actor (actor.py) adds grads and the optimizer.
Sharding follows torchtitan's recipe: `fully_shard` each decoder layer (one all-gather per
layer in forward and backward), then the root, which takes the embeddings, final norm and
head (tied embeddings must share one FSDP group). Params keep the checkpoint's dtype;
gradients are reduce-scattered in fp32 and stored back in the param dtype.

Memory parts (bytes per rank, exact): `params` is the sum of the sharded param storages,
i.e. sum over params of ceil(dim0 / world) * row_size * dtype bytes (FSDP2 pads dim 0 to a
multiple of the world size; at world size 1 this is exactly N * dtype bytes).

Where parts live: `to("host" | "cpu", ...)` offloads through the memory room's PinnedArena
(device storage freed, tensor objects kept) and `to("device" | "cuda", ...)` brings them
back; on a CPU run "cpu" means host and "device" means back. A copy back may still run when
compute starts: the compute that needs the part waits for it (`copy_wait_seconds` adds up
those waits), so the actor's forwards and backwards run while its optimizer state comes
back. The reference never changes, so after its first offload it can be dropped without a
copy (`copy=False`). With memory.offload_mode=fsdp
FSDP2's CPUOffloadPolicy keeps params (and grads, optimizer) on the host for good and copies
each layer in per forward, so `to()` moves nothing.

Micro-batches are right-padded rows of micro_batch_size, or whole sequences packed up to
micro_batch_tokens (trainer/packing.py, attention per sequence in trainer/attention.py); the
head scores tokens in chunks of logprob_chunk_tokens without [tokens x vocab] fp32 logits
when that is > 0 (trainer/logprobs.py). With compile_layers each decoder layer's forward runs
through torch.compile (trainer/compiled.py).

Shape legend: B sequences, T tokens, V vocabulary.
"""

from __future__ import annotations

import time
from typing import Iterator, Protocol

import torch
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard)
from torch.distributed.tensor import DTensor

from handoff.errors import HandoffError
from handoff.memory.staging import PinnedArena, Transfer
from handoff.model_files import ModelFiles, check_loading_info
from handoff.trainer import attention
from handoff.trainer.batch import RolloutBatch
from handoff.trainer.compiled import set_compiled_layers
from handoff.dist import all_reduce_, init_mesh, resolve_device
from handoff.trainer.forward import new_shapes_first, token_forward
from handoff.trainer.gemm_warmup import warm_gemms
from handoff.trainer.logprobs import install_token_head
from handoff.trainer.optim import local_shard
from handoff.trainer.packing import build_micro_batch, micro_batch_rows

_HOST_NAMES = ("host", "cpu")


class Move:
    """The transfers of one `to()` call by part; `wait()` -> {part: {"bytes", "seconds"}}."""

    def __init__(self, transfers: dict[str, Transfer | None]):
        self.transfers = transfers

    def wait(self) -> dict[str, dict[str, float]]:
        out = {}
        for part, t in self.transfers.items():
            if t is not None:
                t.wait()
            out[part] = {"bytes": t.bytes if t else 0, "seconds": t.seconds if t else 0.0}
        return out


def load_hf_model(model: str | ModelFiles, dtype: torch.dtype,
                  gradient_checkpointing: bool) -> torch.nn.Module:
    """A transformers AutoModelForCausalLM on CPU in `dtype`, ready to shard.

    It loads the safetensors files the engine loads (model_files.ModelFiles: config and
    weight files checked before transformers looks), never a pickle, and never a model's
    own code."""
    from transformers import AutoModelForCausalLM

    files = ModelFiles.of(model)
    path = str(files.path)
    # SDPA for padded rows, varlen for packed ones: one registered name (trainer/attention.py).
    attention.register()
    # A tensor of the wrong shape, or none at all, would be a random init: refused instead.
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION,
        ignore_mismatched_sizes=True, output_loading_info=True, use_safetensors=True,
        trust_remote_code=False)
    check_loading_info(path, info)
    model.config.use_cache = False
    if not hasattr(getattr(model, "model", None), "layers"):
        raise HandoffError(f"{type(model).__name__} has no model.layers: the trainer supports "
                           "decoder-only Llama / Qwen2 / Qwen3 style checkpoints")
    install_token_head(model)
    set_activation_checkpointing(model, gradient_checkpointing)
    return model


def set_activation_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Recompute each decoder layer's activations in backward (or stop doing so); works on a
    model FSDP2 has already wrapped (the layers keep their transformers flag)."""
    if on:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        if hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()


class PassHooks(Protocol):
    """Work a caller queues beside a pass over micro-batches (the worker's copies back)."""

    def inputs_ready(self, micro_batches: list) -> None:
        """Every micro-batch's inputs are on the device, no forward queued yet: a copy queued
        later cannot delay them, and `warm_gemms(micro_batches)` can load their GEMMs'
        kernels before any copy runs."""

    def first_launched(self) -> None:
        """The pass's first micro-batches are queued, the device computes them while the host
        works here: in a forward the first of each input shape new to the process, moved to
        the front (forward.new_shapes_first), or else the first one; in an update the first
        one's forward and backward (its order is the order the grads add up in)."""


class ShardedModel:
    """Forward-only FSDP2 model (the reference policy; the actor's base)."""

    trainable = False

    def __init__(self, path: str | ModelFiles, *, role: str = "ref", device: str | torch.device = "cpu",
                 dtype: str = "bfloat16", micro_batch_size: int = 8, offload_mode: str = "arena",
                 arena: PinnedArena | None = None, gradient_checkpointing: bool = False,
                 micro_batch_tokens: int = 0, logprob_chunk_tokens: int = 0,
                 compile_layers: bool = False):
        if offload_mode not in ("arena", "fsdp"):
            raise HandoffError(f"offload_mode={offload_mode!r}: choose arena or fsdp")
        self.role = role
        self.device = resolve_device(device)
        self.mesh = init_mesh(self.device)
        self.world_size = self.mesh.size()
        self.dtype = getattr(torch, dtype)
        self.micro_batch_size = micro_batch_size
        # > 0: whole sequences packed up to this many tokens per micro-batch (trainer/packing.py)
        self.micro_batch_tokens = micro_batch_tokens
        # > 0: the head scores this many tokens at a time, no full logits (trainer/logprobs.py)
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.offload_mode = offload_mode
        self.arena = arena if arena is not None else PinnedArena(pin=self.device.type == "cuda")
        model = load_hf_model(path, self.dtype, gradient_checkpointing and self.trainable)
        if not self.trainable:
            model.requires_grad_(False)
        self.module = self._wrap(model)
        # After sharding: FSDP2's hooks stay outside the compiled forwards (trainer/compiled.py).
        set_compiled_layers(self.module, compile_layers)
        self._parts = {"params": self._param_tensors}
        self._host: set[str] = set()
        self._pending: dict[str, Transfer] = {}      # onloads compute must wait for, by part
        self.copy_wait_seconds = 0.0                 # host seconds compute waited for them
        self._offloads: dict[str, Transfer] = {}     # the last D2H of each part
        self._param_bytes = self._unique_bytes(self._param_tensors())

    # ---- sharding -------------------------------------------------------------------------

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module this model computes with (the actor's LoRA wraps it first)."""
        return self._shard(model)

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        offload = (CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
                   if self.offload_mode == "fsdp" else OffloadPolicy())
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=self.mesh, mp_policy=mp, offload_policy=offload)
        return model

    def _param_tensors(self) -> list[torch.Tensor]:
        return [local_shard(p.detach()) for p in self.module.parameters()]

    @staticmethod
    def _unique_bytes(tensors: list[torch.Tensor]) -> int:
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    # ---- memory parts ---------------------------------------------------------------------

    def memory_parts(self) -> dict[str, int]:
        """Bytes per part on this rank, wherever they live now (see the module docstring)."""
        return {"params": self._param_bytes}

    def part_tensors(self, part: str) -> list[torch.Tensor]:
        """This rank's tensors of memory part `part` (what `to()` moves): "params", and on the
        actor "grads" and "optimizer"."""
        self._check_parts([part])
        return self._parts[part]()

    def _check_parts(self, parts) -> None:
        unknown = sorted(set(parts) - set(self._parts))
        if unknown:
            raise HandoffError(f"{self.role} has no part {unknown[0]!r}: its parts are "
                               f"{sorted(self._parts)}")

    def to(self, where: str | torch.device, *, by_kernel: bool = False,
           programs: int | None = None, copy: bool = True, **parts: bool) -> Move:
        """Start moving the named parts (`params=True`, ...) to 'host' or back to 'device'.

        Asynchronous on CUDA: compute that needs a part waits for its copy first, and
        `.wait()` on the result blocks the host and reports bytes and seconds per part.
        Parts already where asked report 0 bytes. by_kernel: copies back to the device are
        done by a kernel, not the copy engines (PinnedArena.onload; `programs`: on that
        many programs, a few SMs). copy=False (to the host,
        a frozen model only): the device copy is freed and the host copy of the last offload
        kept, 0 bytes moved (PinnedArena.drop).
        """
        self._check_parts(parts)
        to_host = self._is_host(where)
        if to_host:
            # FSDP2 keeps the root's parameters gathered after a forward that no backward
            # follows (the ref's): shard them again, so what moves is always the shards.
            if isinstance(self.module, FSDPModule):   # a LoRA actor on a shared base is not
                self.module.reshard()
        transfers: dict[str, Transfer | None] = {}
        for part in (p for p in self._parts if parts.get(p)):
            if self.offload_mode == "fsdp" or (part in self._host) == to_host:
                transfers[part] = None
            elif to_host:
                transfers[part] = (self._offload_part(part) if copy else self._drop_part(part))
            else:
                # The host copy must be complete before it is read back.
                self._offloads.pop(part).wait()
                transfers[part] = self.arena.onload(self._set_name(part), by_kernel=by_kernel,
                                                    programs=programs)
                self._host.discard(part)
                self._pending[part] = transfers[part]
        return Move(transfers)

    def _is_host(self, where: str | torch.device) -> bool:
        name = str(where)
        if name in _HOST_NAMES:
            return True
        if name == "device" or (name.split(":")[0] == self.device.type):
            return False
        raise HandoffError(f"cannot move {self.role} to {name!r}: use 'host' (or 'cpu') to "
                           f"offload and 'device' (or {self.device.type!r}) to bring it back")

    def _set_name(self, part: str) -> str:
        return f"{self.role}.{part}"

    def _offload_part(self, part: str) -> Transfer | None:
        tensors = self._parts[part]()
        if not tensors:
            return None
        self.arena.stage(self._set_name(part), tensors)
        self._host.add(part)
        self._offloads[part] = self.arena.offload(self._set_name(part), free_device=True)
        return self._offloads[part]

    def _drop_part(self, part: str) -> Transfer:
        if self.trainable:
            raise HandoffError(f"{self.role} {part} change as it trains, so their host copy is "
                               f"stale: offload them with a copy ({self.role}.to('host', "
                               f"{part}=True))")
        self._offloads[part] = self.arena.drop(self._set_name(part), self._parts[part]())
        self._host.add(part)
        return self._offloads[part]

    def _check_on_device(self, *parts: str) -> None:
        """Refuse a step whose parts are on the host (their copy back not even started)."""
        for part in parts:
            if part in self._host:
                raise HandoffError(f"{self.role} {part} are offloaded to host memory: call "
                                   f"{self.role}.to('device', {part}=True) before this step")

    def require_on_device(self, *parts: str) -> None:
        """The parts on the device, their copies back landed. The host waits for a copy still
        running, so a wait counts as the compute's only once the compute stream has drained:
        Actor.step waits for the optimizer's copy after the grad norm has synced it."""
        self._check_on_device(*parts)
        for part in parts:
            transfer = self._pending.pop(part, None)
            if transfer is not None:
                t0 = time.perf_counter()
                transfer.wait()
                self.copy_wait_seconds += time.perf_counter() - t0

    # ---- forward --------------------------------------------------------------------------

    def _micro_batches(self, batch: RolloutBatch) -> list[tuple[object, bool]]:
        """(micro-batch, real) pairs, every one's inputs on the device before any forward
        runs (a copy queued after that cannot hold them back); every rank runs the same
        count (FSDP collectives must pair up), so a rank with fewer repeats its first one as
        a discarded dummy."""
        if len(batch) == 0:
            raise HandoffError(f"{self.role} got an empty batch: every rank needs at least one row")
        lengths = [int(n) for n in batch.attention_mask.sum(1).tolist()]
        groups = micro_batch_rows(lengths, micro_batch_tokens=self.micro_batch_tokens,
                                  micro_batch_size=self.micro_batch_size)
        count = len(groups)
        count_all = int(all_reduce_(torch.tensor([count], device=self.device), "max").item())
        return [(build_micro_batch(batch, groups[i] if i < count else groups[0], lengths,
                                   self.device, packed=self.micro_batch_tokens > 0), i < count)
                for i in range(count_all)]

    @torch.no_grad()
    def log_probs(self, batch: RolloutBatch, *, with_entropy: bool = True,
                  hooks: PassHooks | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs [B, T] (and entropy [B, T]) in fp32 on the batch's device.
        `hooks`: work queued beside the forwards (PassHooks)."""
        micro_batches, ahead = self._micro_batches(batch), 1
        if hooks is not None:   # the order of the rows' scores does not change them
            micro_batches, new = new_shapes_first(micro_batches)
            ahead = max(new, 1)
            hooks.inputs_ready(micro_batches)
        self.require_on_device("params")
        self.module.eval()
        b, t = batch.input_ids.shape
        logp_BT = torch.zeros(b, t, dtype=torch.float32, device=self.device)
        ent_BT = torch.zeros_like(logp_BT) if with_entropy else None
        for i, (mb, real) in enumerate(micro_batches):
            logp, ent = token_forward(self.module, mb, chunk_tokens=self.logprob_chunk_tokens,
                                      with_entropy=with_entropy)
            if real:
                mb.scatter(logp_BT, logp)
                if with_entropy:
                    mb.scatter(ent_BT, ent)
            del logp, ent
            if i + 1 == ahead and hooks is not None:
                hooks.first_launched()
        out = batch.input_ids.device
        return logp_BT.to(out), (ent_BT.to(out) if with_entropy else None)

    def warm_gemms(self, micro_batches: list, *, backward: bool = False) -> int:
        """Launch the GEMM shapes of these micro-batches' forward (and the Linears' backward)
        not launched before in this process (train.gemm_warmup says why); returns how many."""
        return warm_gemms(self.module, [tuple(mb.input_ids.shape) for mb, _ in micro_batches],
                          chunk_tokens=self.logprob_chunk_tokens, device=self.device,
                          backward=backward)

    # ---- weights out ----------------------------------------------------------------------

    def full_params(self, dtype: torch.dtype | str | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor on the device) one parameter at a time, all-gathered from the
        shards and cast to `dtype`; the previous one is released before the next is gathered.
        Tied weights appear once, under their first name (e.g. model.embed_tokens.weight).
        Collective: every rank must run the generator to the end, in step.

        Not under no_grad: every tensor is detached first (nothing records a graph), and a
        no_grad generator re-enters the mode at every yield (~4 us per tensor of host work)."""
        self.require_on_device("params")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        for name, p in self.module.named_parameters():
            full = self._gather(p)
            if dtype is not None and full.dtype != dtype:
                full = full.to(dtype)
            yield name, full
            del full

    def full_shapes(self) -> Iterator[tuple[str, torch.Size]]:
        """(HF name, full shape) of every tensor full_params yields, in its order, gathering
        nothing (a DTensor's shape is the full tensor's)."""
        for name, p in self.module.named_parameters():
            yield name, p.shape

    def _gather(self, p: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            # The shard is the full tensor: hand it over, no copy. Detached as a plain
            # tensor: a DTensor's own detach dispatches through Python (~20 us per
            # parameter on the H200's host, a third of the sync's host time).
            shard = local_shard(p).detach()
            return shard if self.offload_mode == "arena" else shard.to(self.device)
        if not isinstance(p, DTensor):   # a replica's tensor (LoRA on a shared base): whole
            return p.detach()
        shard = local_shard(p.detach())
        if shard.device != self.device:   # CPUOffloadPolicy keeps shards on the host
            p = DTensor.from_local(shard.to(self.device), p.device_mesh, p.placements,
                                   run_check=False, shape=p.shape, stride=p.stride())
        return p.detach().full_tensor()
