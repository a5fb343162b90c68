"""AdamW over FSDP2 shards with fp32 master weights: the 12 bytes/param of the source's layout.

For each parameter shard this rank owns it keeps, all fp32 and allocated once up front, as
views of one flat buffer (`flat`):
  master      a copy of the shard (4 B/param), only when the params are not fp32 themselves
  exp_avg     Adam's first moment (4 B/param)
  exp_avg_sq  Adam's second moment (4 B/param)
A step reads the (bf16) grad shard, updates the fp32 master, and writes the master back into
the (bf16) param shard, so rounding happens once per step, never in the moments. With fp32
params (CPU tests) the param shard is its own master: 8 B/param.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), one
tensor at a time so the transient extra memory is one fp32 shard, not a copy of the model.

The learning rate of each step comes from `LrSchedule.lr_at(step)`, a closed form of the
optimizer's step count: the values torch's SequentialLR of LinearLR (warm-up) and
CosineAnnealingLR or LinearLR (decay) gives, computed without their recursion, so a resume,
which restores the step count from the checkpoint, continues the sequence exactly with
nothing else to store (torch's schedulers also require a torch.optim.Optimizer, which this
flat-buffer AdamW is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or a plain tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LrSchedule:
    """actor.lr_schedule: the learning rate of optimizer step k (1-based).

    Warm-up, k <= warmup_steps: lr * k / warmup_steps (no step at lr 0). Then `constant`
    stays at lr; `cosine` and `linear` fall from lr towards 0 over the remaining
    total_steps - warmup_steps steps, the first of them at lr and the last above 0:
    with p = (k - 1 - warmup_steps) / (total_steps - warmup_steps),
    cosine lr * (1 + cos(pi p)) / 2, linear lr * (1 - p); 0 past total_steps.
    """

    lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.kind!r} is not one of {', '.join(LR_SCHEDULES)}")
        if self.kind != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule={self.kind!r} decays to 0 at the run's last "
                             "optimizer step: pass total_steps (run.steps * updates_per_step)")

    def lr_at(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        decay_steps = self.total_steps - self.warmup_steps
        progress = min((step - 1 - self.warmup_steps) / decay_steps, 1.0)
        if self.kind == "cosine":
            return self.lr * (1 + math.cos(math.pi * progress)) / 2
        return self.lr * (1 - progress)


class MixedPrecisionAdamW:
    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        shards = []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            shard = local_shard(p.detach())
            kinds = ["exp_avg", "exp_avg_sq"] + (["master"] if shard.dtype != torch.float32
                                                 else [])
            self.names.append(name)
            self.params.append(p)
            shards.append((name, shard, kinds))
        # Every state tensor is a view of one flat fp32 buffer: the optimizer part moves as one
        # storage (one allocation and a few large copies per switch, not one per tensor:
        # docs/PERF.md, "The streamed switch").
        total = sum(shard.numel() * len(kinds) for _, shard, kinds in shards)
        device = shards[0][1].device if shards else torch.device("cpu")
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        offset = 0
        for name, shard, kinds in shards:
            self.state[name] = {}
            for kind in kinds:
                view = self.flat[offset:offset + shard.numel()].view(shard.shape)
                if kind == "master":
                    view.copy_(shard)
                self.state[name][kind] = view
                offset += shard.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor by '<param name>/<kind>': what offload and checkpoints move."""
        return {f"{n}/{k}": t for n, kinds in self.state.items() for k, t in kinds.items()}

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        """One AdamW step on every shard that has a grad; grads are multiplied by `grad_scale`
        in fp32 first (grad-norm clipping without rounding the bf16 grads twice)."""
        self.step_count += 1
        beta1, beta2 = self.betas
        bias1 = 1 - beta1 ** self.step_count
        bias2_sqrt = math.sqrt(1 - beta2 ** self.step_count)
        step_size = self.lr / bias1
        for name, p in zip(self.names, self.params):
            if p.grad is None:
                continue
            kinds = self.state[name]
            shard = local_shard(p.detach())
            master = kinds.get("master", shard)
            grad = local_shard(p.grad).float()
            if grad_scale != 1.0:
                grad = grad * grad_scale
            if self.weight_decay:
                master.mul_(1 - self.lr * self.weight_decay)
            kinds["exp_avg"].lerp_(grad, 1 - beta1)
            kinds["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = kinds["exp_avg_sq"].sqrt().div_(bias2_sqrt).add_(self.eps)
            master.addcdiv_(kinds["exp_avg"], denom, value=-step_size)
            if master is not shard:
                shard.copy_(master)

    def zero_grad(self) -> None:
        """Free the grads (set to None): after a step they are dropped, never moved."""
        for p in self.params:
            p.grad = None
