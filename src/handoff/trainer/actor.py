"""The actor: an FSDP2 policy with fp32-master AdamW and the GRPO update.

    actor = build_actor(cfg, RunPlan.build(cfg), device="cuda", arena=arena)
    batch.old_logprobs, _ = actor.log_probs(batch)
    metrics = actor.update(batch)      # loss, pg_loss, clip_frac, kl, entropy, grad_norm, actor/lr
    actor.to("host", optimizer=True).wait()

Memory parts per rank (bytes, exact; N_r = this rank's share of the N params, which FSDP2
pads so that dim 0 splits evenly across ranks; at world size 1 N_r = N):
  params     N_r x dtype bytes          (2 for bf16; 4 for the fp32 CPU tests)
  grads      N_r x dtype bytes          (exist only between backward and the optimizer step:
                                         `update` frees them, they are never moved)
  optimizer  N x 12 with bf16 params (fp32 master + exp_avg + exp_avg_sq), N x 8 with fp32
             params (no separate master); N counts unpadded local elements.
So a bf16 model costs the source's 16 bytes/param while training.

Loss aggregation (actor.loss_agg, grpo.py) is over the whole batch of one optimizer step on
every rank: each micro-batch contributes its weighted token sum * world / the denominator of
all ranks' counts (token_mean: the response tokens), and FSDP's gradient average over ranks
divides the world back out. The `loss` metric is the token mean of the per-token loss under
every aggregation. The learning rate follows actor.lr_schedule (optim.LrSchedule), a
function of the optimizer's step count, which every checkpoint keeps.

LoRA (actor.lora.rank > 0, trainer/lora.py): only the adapters train, so grads and optimizer
count them alone. With `engine_base` (actor.lora.share_base) the base is the engine's weights
and the module is not FSDP-wrapped: each rank holds the whole adapters (the `params` part,
the only one `to()` moves), a replica whose grads `step` averages over ranks first. The
reference is this model with its adapters off (`base_log_probs`).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from handoff.config import ActorConfig, Config
from handoff.errors import HandoffError
from handoff.memory.staging import PinnedArena
from handoff.model_files import ModelFiles
from handoff.plan.trainer import MicroBatchChoice
from handoff.runplan import RunPlan
from handoff.trainer import grpo
from handoff.trainer.batch import RolloutBatch
from handoff.dist import all_reduce_, broadcast_
from handoff.trainer.forward import token_forward
from handoff.trainer.lora import (adapter_parameters, adapters_disabled, inject_adapters,
                                  share_base)
from handoff.trainer.model import PassHooks, ShardedModel
from handoff.trainer.optim import LrSchedule, MixedPrecisionAdamW, local_shard


class Actor(ShardedModel):
    trainable = True
    micro_batch_choice: MicroBatchChoice | None = None   # set by build_actor for 'auto'

    def __init__(self, path: str | ModelFiles, *, actor: ActorConfig, device: str | torch.device = "cpu",
                 dtype: str = "bfloat16", offload_mode: str = "arena",
                 arena: PinnedArena | None = None, role: str = "actor",
                 max_response_len: int | None = None, total_updates: int | None = None,
                 engine_base: Callable[[str], torch.Tensor] | None = None):
        """`max_response_len` (rollout.max_tokens): loss_agg=seq_mean_token_sum_norm's
        constant; `total_updates` (run.steps * updates_per_step): where a cosine or linear
        lr_schedule reaches 0 (build_actor passes both from the run's config). An
        actor.compile left 'auto' (no plan priced it: an actor built by hand) stays eager.
        `engine_base` (actor.lora with share_base): HF name -> the engine's tensor, which the
        frozen base becomes a view of (trainer/lora.py); the module is then not sharded."""
        self.cfg = actor
        self.lora = actor.lora if actor.lora.rank else None
        if engine_base is not None and self.lora is None:
            raise HandoffError("engine_base is the base a LoRA actor shares: set actor.lora.rank")
        self._engine_base = engine_base
        self._adapters: list[tuple[str, torch.nn.Parameter]] = []   # (name, param), _wrap's
        # Data-parallel replicas of the adapters: grads averaged by hand (_average_grads).
        self.replicated = engine_base is not None
        if not isinstance(actor.micro_batch_tokens, int) or not isinstance(
                actor.gradient_checkpointing, bool):
            raise HandoffError("actor.micro_batch_tokens / gradient_checkpointing are 'auto': "
                               "build the actor with build_actor(cfg, plan, ...), which resolves them")
        super().__init__(path, role=role, device=device, dtype=dtype,
                         micro_batch_size=actor.micro_batch_size, offload_mode=offload_mode,
                         arena=arena, gradient_checkpointing=actor.gradient_checkpointing,
                         micro_batch_tokens=actor.micro_batch_tokens,
                         logprob_chunk_tokens=actor.logprob_chunk_tokens,
                         compile_layers=actor.compile is True)
        if actor.loss_agg == "seq_mean_token_sum_norm" and not max_response_len:
            raise HandoffError("actor.loss_agg=seq_mean_token_sum_norm needs the longest "
                               "response: build the actor with build_actor(cfg, ...) or pass "
                               "max_response_len")
        self.max_response_len = max_response_len
        self.schedule = LrSchedule(actor.lr, kind=actor.lr_schedule,
                                   warmup_steps=actor.warmup_steps, total_steps=total_updates)
        self.optimizer = MixedPrecisionAdamW(self.module.named_parameters(), lr=actor.lr,
                                             weight_decay=actor.weight_decay)
        self._parts["grads"] = self._grad_tensors
        self._parts["optimizer"] = lambda: list(self.optimizer.tensors().values())
        # Under LoRA only the adapters have grads.
        self._grad_bytes = self._param_bytes if self.lora is None else self._unique_bytes(
            [local_shard(p.detach()) for p in self.optimizer.params])

    # ---- LoRA (trainer/lora.py) -----------------------------------------------------------

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.lora is None:
            return super()._wrap(model)
        model = inject_adapters(model, self.lora)
        if self._engine_base is None:
            model = self._shard(model)
        else:
            share_base(model, self._engine_base, device=self.device, dtype=self.dtype)
        # Listed once, after sharding (which replaces the parameters): walking a 14B's
        # modules for them took milliseconds of the device's slow host at every sync.
        self._adapters = adapter_parameters(model)
        if self._engine_base is not None:
            # Same seed, same init on every rank already; rank 0's copy makes it certain.
            for _, p in self._adapters:
                broadcast_(p.data)
        return model

    def _param_tensors(self) -> list[torch.Tensor]:
        if self.replicated:   # the base is the engine's: "params" are the adapters only
            return [p.detach() for _, p in self._adapters]
        return super()._param_tensors()

    def adapter_tensors(self, dtype: torch.dtype | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """(peft name, whole adapter tensor cast to `dtype`), gathered from the shards without
        share_base (collective then: every rank runs it to the end)."""
        self.require_on_device("params")
        for name, p in self._adapters:
            full = self._gather(p)
            yield name, (full if dtype is None or full.dtype == dtype else full.to(dtype))

    def base_log_probs(self, batch: RolloutBatch, *, hooks: PassHooks | None = None
                       ) -> torch.Tensor:
        """The reference's log-probs under LoRA: this model with its adapters off."""
        with adapters_disabled(self.module):
            return self.log_probs(batch, with_entropy=False, hooks=hooks)[0]

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [local_shard(p.grad) for p in self.optimizer.params if p.grad is not None]

    def memory_parts(self) -> dict[str, int]:
        # A grad shard has its param's dtype and FSDP's padded shard size.
        return {"params": self._param_bytes, "grads": self._grad_bytes,
                "optimizer": self.optimizer.nbytes()}

    # ---- the GRPO update ------------------------------------------------------------------

    def update(self, batch: RolloutBatch, *, hooks: PassHooks | None = None,
               backward_done: Callable[[], None] | None = None) -> dict[str, float]:
        """GRPO on this rank's rows: advantages from rewards, then `updates_per_step` optimizer
        steps over consecutive slices; returns metrics averaged over those steps.
        `hooks` (model.PassHooks): their inputs are every slice's micro-batches, their first
        launch the first micro-batch's forward and backward; `backward_done()` after the last
        backward, before its optimizer step (the activations' memory is free then)."""
        cfg = self.cfg
        if cfg.kl_coef > 0 and batch.ref_logprobs is None:
            raise HandoffError(f"actor.kl_coef={cfg.kl_coef} but the batch has no ref_logprobs: "
                               "run ref.log_probs(batch) first, or set actor.kl_coef=0")
        if len(batch) < cfg.updates_per_step:
            raise HandoffError(f"{len(batch)} rows cannot feed actor.updates_per_step="
                               f"{cfg.updates_per_step}: lower it or sample more rows")
        self._check_on_device("params")
        batch.advantages = grpo.group_advantages(batch.rewards, batch.group_size,
                                                 scale=cfg.scale_advantages)
        if batch.old_logprobs is None and cfg.updates_per_step > 1:
            # Later slices see a moved policy, so the ratio needs the sampling policy's log-probs.
            batch.old_logprobs, _ = self.log_probs(batch, with_entropy=False)
        b, steps = len(batch), cfg.updates_per_step
        bounds = [round(i * b / steps) for i in range(steps + 1)]
        minis = [batch.rows(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        prepared = [(mini, self._micro_batches(mini)) for mini in minis]
        if hooks is not None:   # they may queue the optimizer's copy back at the first launch
            hooks.inputs_ready([pair for _, micro_batches in prepared for pair in micro_batches])
        else:   # its copy back may still run: only its step waits for it (step())
            self._check_on_device("optimizer")
        history = [self._one_step(mini, micro_batches,
                                  first_launched=hooks.first_launched if hooks and i == 0 else None,
                                  backward_done=backward_done if i == len(prepared) - 1 else None)
                   for i, (mini, micro_batches) in enumerate(prepared)]
        return {k: sum(h[k] for h in history) / len(history) for k in history[0]}

    def _one_step(self, mini: RolloutBatch, micro_batches: list, *,
                  first_launched: Callable[[], None] | None,
                  backward_done: Callable[[], None] | None) -> dict[str, float]:
        sums = self.accumulate(mini, micro_batches, first_launched=first_launched)
        values = dict(zip(grpo.LossSums.NAMES, sums.tolist()))
        if backward_done is not None:
            backward_done()
        grad_norm = self.step()
        n = max(values.pop("num_tokens"), 1.0)
        metrics = {k: v / n for k, v in values.items()}
        metrics.update({"num_tokens": n, "grad_norm": grad_norm, "actor/lr": self.optimizer.lr,
                        "skipped_step": float(not math.isfinite(grad_norm))})
        return metrics

    def accumulate(self, batch: RolloutBatch, micro_batches: list | None = None, *,
                   first_launched: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward + backward of every micro-batch of `batch` (advantages set; its micro-batches
        built already, or now), grads summed into the shards; returns the LossSums of all ranks
        added up (see grpo.LossSums.NAMES). `first_launched()` runs once the first
        micro-batch's backward is queued."""
        cfg = self.cfg
        assert batch.advantages is not None, "set batch.advantages (grpo.group_advantages) first"
        self.require_on_device("params", "grads")
        self.module.train()
        mask = batch.response_mask.float()
        num_tokens, num_sequences = all_reduce_(torch.stack(
            [mask.sum(), (mask.sum(dim=1) > 0).float().sum()]).to(self.device)).tolist()
        scale = self.world_size / grpo.aggregation_denominator(
            cfg.loss_agg, num_tokens=num_tokens, num_sequences=num_sequences,
            max_response_len=self.max_response_len)
        weights = grpo.aggregation_weights(mask, cfg.loss_agg)
        sums = torch.zeros(len(grpo.LossSums.NAMES), device=self.device)
        for i, (mb, real) in enumerate(micro_batches or self._micro_batches(batch)):
            logp, ent = token_forward(self.module, mb, chunk_tokens=self.logprob_chunk_tokens,
                                      with_entropy=True, entropy_grad=cfg.entropy_coef > 0)
            old = mb.gather(batch.old_logprobs)
            s = grpo.grpo_loss_sums(
                logp, old if old is not None else logp.detach(), mb.advantages(batch.advantages),
                mb.gather(batch.response_mask), clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                ref_logp_BT=mb.gather(batch.ref_logprobs) if cfg.kl_coef > 0 else None,
                kl_coef=cfg.kl_coef, entropy_BT=ent, entropy_coef=cfg.entropy_coef,
                weight_BT=mb.gather(weights))
            # A dummy micro-batch only keeps FSDP's collectives paired across ranks.
            (s.objective * (scale if real else 0.0)).backward()
            if real:
                sums += s.stacked()
            del logp, ent, s
            if i == 0 and first_launched is not None:
                first_launched()
        return all_reduce_(sums)

    def step(self) -> float:
        """Clip by the global grad norm, one AdamW step, free the grads; returns the norm
        before clipping (a non-finite norm skips the step).

        The first thing that needs the optimizer's state is its step: a copy of it still
        running is waited for here, after the norm has synced the compute stream, so the
        wait is exactly the time the copy outlived the forwards and backwards."""
        self.require_on_device("params", "grads")
        if self.replicated:
            self._average_grads()
        grad_norm = self._grad_norm()
        self.require_on_device("optimizer")
        self.optimizer.lr = self.schedule.lr_at(self.optimizer.step_count + 1)
        if math.isfinite(grad_norm):
            clip = self.cfg.grad_clip / (grad_norm + 1e-6) if self.cfg.grad_clip > 0 else 1.0
            self.optimizer.step(grad_scale=min(1.0, clip))
        self.optimizer.zero_grad()
        return grad_norm

    def _grad_norm(self) -> float:
        """Global L2 norm of all grad shards (fp32), summed over ranks."""
        grads = self._grad_tensors()
        where = grads[0].device if grads else self.device
        sq = torch.zeros((), dtype=torch.float32, device=where)
        for g in grads:
            sq += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
        # Shards add up over ranks; replicas hold the whole (averaged) grads each.
        return math.sqrt(float((sq if self.replicated else all_reduce_(sq)).item()))

    def _average_grads(self) -> None:
        """The replicas' adapter grads averaged over ranks in fp32, one all-reduce (megabytes):
        what FSDP's reduce-scatter does for a sharded model."""
        grads = self._grad_tensors()
        if self.world_size == 1 or not grads:
            return
        flat = all_reduce_(torch.cat([g.reshape(-1).float() for g in grads]))
        flat /= self.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def resolve_actor_config(plan: RunPlan, device: str | torch.device
                         ) -> tuple[ActorConfig, MicroBatchChoice | None]:
    """The run's actor config with 'auto' resolved for `device` (RunPlan.actor_config: a
    CUDA card smaller than the profile's HBM sizes the budget; compile priced for its kind)."""
    dev = torch.device(device) if str(device) != "auto" else None
    total = None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(dev).total_memory
    return plan.actor_config(total, device_type=dev.type if dev is not None else None)


def build_actor(cfg: Config, plan: RunPlan, *, device: str | torch.device,
                arena: PinnedArena | None = None, files: ModelFiles | None = None,
                engine_base: Callable[[str], torch.Tensor] | None = None) -> Actor:
    """The actor from a run config: model.path (or `files`, the run's opened model.path) /
    model.dtype, actor.* ('auto' resolved by resolve_actor_config, the choice kept as
    actor.micro_batch_choice), memory.offload_mode; `engine_base`: the engine's tensors a
    LoRA actor's base shares (Actor)."""
    actor_cfg, choice = resolve_actor_config(plan, device)
    actor = Actor(files or cfg.model.path, actor=actor_cfg, device=device, dtype=cfg.model.dtype,
                  offload_mode=cfg.memory.offload_mode, arena=arena,
                  max_response_len=cfg.rollout.max_tokens,
                  total_updates=cfg.run.steps * actor_cfg.updates_per_step,
                  engine_base=engine_base)
    actor.micro_batch_choice = choice
    return actor


def build_reference(cfg: Config, plan: RunPlan, *, device: str | torch.device,
                    arena: PinnedArena | None = None,
                    files: ModelFiles | None = None) -> ShardedModel | None:
    """The frozen reference model, or None when actor.kl_coef == 0 (no KL term at all) or
    under LoRA (the reference is the actor with its adapters off: Actor.base_log_probs); its
    forwards use the actor's micro-batches, log-prob head and compiled layers."""
    if cfg.actor.kl_coef == 0 or cfg.actor.lora.rank:
        return None
    actor_cfg, _ = resolve_actor_config(plan, device)
    return ShardedModel(files or cfg.model.path, role="ref", device=device, dtype=cfg.model.dtype,
                        micro_batch_size=actor_cfg.micro_batch_size,
                        micro_batch_tokens=actor_cfg.micro_batch_tokens,
                        logprob_chunk_tokens=actor_cfg.logprob_chunk_tokens,
                        compile_layers=actor_cfg.compile,
                        offload_mode=cfg.memory.offload_mode, arena=arena)
