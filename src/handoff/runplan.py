"""The run's plan: the planner's inputs for one run, built once at start (by the preflight,
or by `loop.train` when called from Python) and handed to the calibration, the actor, the
report and the checkpoint sizing, which used to rebuild them each on its own.

    plan = RunPlan.build(cfg)                      # no torch: the model's config.json only
    plan.shape, plan.hardware, plan.dtypes, plan.ref, plan.elastic_pool, plan.order
    plan.compile.text()                            # actor.compile: on or off, and why
    actor_cfg, choice = plan.actor_config(device_hbm_bytes, device_type="cuda")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from handoff import compile_cache
from handoff.config import ActorConfig, Config
from handoff.plan.compile import CompileChoice, choose_compile, named_device
from handoff.plan.hardware import HardwareProfile, hardware_profile
from handoff.plan.ledger import Dtypes, shard_size
from handoff.plan.lora import BaseCopies, adapter_params, adapter_state_bytes
from handoff.plan.order import SwitchOrder, switch_order
from handoff.plan.shapes import ModelShape, load_shape
from handoff.plan.trainer import MicroBatchChoice, full_train_state_bytes, pick_micro_batch


@dataclass(frozen=True)
class RunPlan:
    """What the ledger needs to know of a run: the model's shape, the hardware profile
    (cfg.hardware's overrides applied; the rates a run measures are applied by its report),
    the dtypes, the FSDP shard, whether there is a reference model (none under LoRA: the
    actor with its adapters off), the KV pool's kind, the switch order those give, and
    actor.compile decided for the device the config names (run.device, else CUDA for a GPU
    profile)."""

    cfg: Config
    shape: ModelShape
    hardware: HardwareProfile
    dtypes: Dtypes
    shard: int
    ref: bool
    elastic_pool: bool
    order: SwitchOrder
    compile: CompileChoice

    @classmethod
    def build(cls, cfg: Config) -> "RunPlan":
        lora = cfg.actor.lora
        ref = cfg.actor.kl_coef > 0 and not lora.rank   # LoRA's: the actor, adapters off
        elastic = cfg.rollout.kv_pool == "elastic"
        shape = load_shape(cfg.model.path)
        hw = hardware_profile(cfg.hardware.name or "cpu", cfg.hardware)
        return cls(cfg=cfg, shape=shape, hardware=hw,
                   dtypes=Dtypes.for_model(cfg.model.dtype, cfg.rollout.kv_dtype),
                   shard=shard_size(cfg.parallel), ref=ref, elastic_pool=elastic,
                   order=switch_order(cfg.memory, ref=ref, elastic_pool=elastic,
                                      updates_per_step=cfg.actor.updates_per_step,
                                      lora=lora.shares_base),
                   compile=compile_for(cfg, shape, hw, named_device(cfg, hw)))


    def compile_on(self, device_type: str | None = None) -> CompileChoice:
        """actor.compile for a `device_type` card ('cuda', 'cpu'; None: the one the config
        names): the planned choice, or the one priced for the device the run got."""
        if device_type is None or device_type == named_device(self.cfg, self.hardware):
            return self.compile
        return compile_for(self.cfg, self.shape, self.hardware, device_type)

    def actor_config(self, device_hbm_bytes: int | None = None, *,
                     device_type: str | None = None
                     ) -> tuple[ActorConfig, MicroBatchChoice | None]:
        """cfg.actor with 'auto' resolved: compile for a `device_type` card (compile_on; None:
        the device the config names), micro_batch_tokens / gradient_checkpointing from the
        memory the card has in the training phase (plan.trainer.pick_micro_batch: the
        profile's HBM, or the device's if smaller, less the trainer state and the resident
        bytes); the micro-batch choice is returned with its reason (None when not auto)."""
        cfg = self.cfg
        a = dataclasses.replace(cfg.actor, compile=self.compile_on(device_type).on)
        if a.micro_batch_tokens != "auto" and a.gradient_checkpointing != "auto":
            return a, None
        hw = self.hardware
        if device_hbm_bytes is not None:
            hw = dataclasses.replace(hw, hbm_bytes=min(hw.hbm_bytes, device_hbm_bytes))
        # Padded rows: the micro-batch is micro_batch_size rows of up to max_model_len tokens.
        tokens = a.micro_batch_tokens if a.micro_batch_tokens != 0 else (
            a.micro_batch_size * cfg.rollout.max_model_len)
        choice = pick_micro_batch(self.shape, hw, dtypes=self.dtypes, shard=self.shard,
                                  checkpointing=a.gradient_checkpointing,
                                  logprob_chunk_tokens=a.logprob_chunk_tokens,
                                  longest_sequence=cfg.rollout.max_model_len, tokens=tokens,
                                  state_bytes=self.train_state_bytes())
        resolved = dataclasses.replace(
            a, gradient_checkpointing=choice.checkpointing,
            micro_batch_tokens=(choice.tokens if a.micro_batch_tokens == "auto"
                                else a.micro_batch_tokens))
        return resolved, choice

    def train_state_bytes(self) -> int:
        """The trainer state a card holds through the update. Full-parameter: 16N/n. LoRA:
        the frozen base (whole when it is the engine's weights, else the trainer's own shard)
        and the adapters' params, grads, fp32 master + Adam."""
        cfg, lora = self.cfg, self.cfg.actor.lora
        if not lora.rank:
            return full_train_state_bytes(self.shape, self.dtypes, self.shard)
        bases = BaseCopies.of_run(self.shape, lora, cfg.memory, cfg.parallel, self.dtypes)
        adapters = adapter_params(self.shape, lora.rank, lora.target_modules)
        return bases.trainer + sum(adapter_state_bytes(adapters, self.dtypes).values())

    def checkpoint_param_bytes(self) -> int:
        """Bytes per parameter a checkpoint holds: the params in the model's dtype, the fp32
        master copy (none for fp32 params) and Adam's two fp32 moments."""
        d = self.dtypes
        return d.param_bytes + d.master_bytes + d.optimizer_bytes


def compile_for(cfg: Config, shape: ModelShape, hw: HardwareProfile, device_type: str
                ) -> CompileChoice:
    """actor.compile priced for a run of `cfg` on a `device_type` card (plan.compile), warm
    when the persistent cache holds this layer shape (handoff.compile_cache)."""
    warm = compile_cache.is_warm(compile_cache.layer_key(shape, cfg.model.dtype))
    return choose_compile(cfg, shape, hw, device_type=device_type, warm=warm)
