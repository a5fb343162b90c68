"""Whether compiled decoder layers pay for their compile (`actor.compile=auto`).

    choice = choose_compile(cfg, shape, hw, device_type="cuda", warm=False)
    choice.on, choice.reason          # e.g. off: 4 steps save 8.0 s, the compile costs 35 s

The compile is paid once per process (torch.compile's first micro-batches, the actor's graph
with grad and the reference's without); every step after it saves a share of the trainer's
compute. So auto turns it on when run.steps x that saving exceeds the compile's seconds:

  saving per step = train_seconds (plan.trainer: model FLOPs / train_flops_per_s, the eager
                    rate) x COMPILED_TRAIN_SAVING
  compile seconds = COLD_COMPILE_SECONDS, or WARM_COMPILE_SECONDS when this layer shape was
                    compiled into the persistent cache before (handoff.compile_cache)

The trainer's tokens per card and step are the run's (`handoff train`): data.prompts_per_step
x rollout.n sequences over parallel.gpus cards, each workload.prompt_len +
workload.response_len tokens (the response capped at rollout.max_tokens); `handoff plan`
prices the step it models, the workload's tokens (plan.report.trained_tokens_per_card). A CPU run stays eager: inductor's CPU compile
takes minutes on a small host and the CPU demo's numbers stay the eager path's.

Where the constants come from (docs/PERF.md, "The trainer's compute", H200):
* COMPILED_TRAIN_SAVING: `handoff bench train-compute` on the 4B colocated step's shape,
  packed 7.74 s -> compiled 5.89 s (ref forward + actor forward/backward + optimizer, -24%,
  2026-12-04); in the colocated step `timing_s/train` 8.70 s -> 6.36-6.45 s (-26%,
  2026-12-05).
* COLD_COMPILE_SECONDS: the colocated 4B step compiled with an empty cache (2026-12-05,
  `scripts/device/4-compile-second-start.sh`): its first step trained for 41.37 s against
  6.36 s in its second, where the eager run's first and second differ by 0.10 s: 34.9 s of
  compiling (36 layers of one shape share one compiled code: the figure is per layer shape).
* WARM_COMPILE_SECONDS: the same config again in a new process with that cache
  (HANDOFF_CACHE): its first step trained for 15.15 s against 6.45 s: 8.6 s (dynamo still
  traces; the FX graph and AOTAutograd caches skip inductor's code generation and Triton's
  builds).

The plan's modelled step trains at the compiled rate when the choice is on (`compiled_rate`:
the profile's eager train_flops_per_s / (1 - COMPILED_TRAIN_SAVING), 317 -> 417 TFLOP/s on
the h200 profile against 408 measured); the compile itself is the choice's one-off cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from handoff.config import Config
from handoff.plan.hardware import HardwareProfile
from handoff.plan.shapes import ModelShape
from handoff.plan.trainer import train_seconds

COMPILED_TRAIN_SAVING = 0.24
COLD_COMPILE_SECONDS = 35.0
WARM_COMPILE_SECONDS = 8.6


@dataclass(frozen=True)
class CompileChoice:
    on: bool                      # actor.compile, resolved
    requested: str                # actor.compile as given: "auto", "true" or "false"
    compile_seconds: float        # what the compile is expected to cost (0 when not priced)
    saving_seconds: float         # what it saves over the run's steps (0 when not priced)
    warm: bool                    # the persistent cache held this layer shape already
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        return f"compiled layers: {'on' if self.on else 'off'} ({self.reason})"


def named_device(cfg: Config, hw: HardwareProfile) -> str:
    """The device kind a config runs on: run.device, or for 'auto' CUDA on a GPU profile."""
    if cfg.run.device != "auto":
        return cfg.run.device
    return "cpu" if hw.name == "cpu" else "cuda"


def run_train_tokens_per_card(cfg: Config) -> float:
    """Prompt + response tokens one card trains on per step (see the module docstring)."""
    sequences = cfg.data.prompts_per_step * cfg.rollout.n / cfg.parallel.gpus
    response = min(cfg.workload.response_len, cfg.rollout.max_tokens)
    return sequences * (cfg.workload.prompt_len + response)


def price_compile(requested: bool | str, *, device_type: str, hardware: str,
                  train_seconds_per_step: float, steps: int, warm: bool,
                  tokens_per_step: float | None = None) -> CompileChoice:
    """actor.compile resolved: a boolean as given; 'auto' on only for a CUDA run priced on a
    GPU profile whose `steps` save more than the compile costs (`tokens_per_step`, the
    tokens a card trains on, only named in the reason)."""
    if isinstance(requested, bool):
        return CompileChoice(on=requested, requested=str(requested).lower(), compile_seconds=0.0,
                             saving_seconds=0.0, warm=warm,
                             reason=f"actor.compile={str(requested).lower()}")

    def off(reason: str) -> CompileChoice:
        return CompileChoice(on=False, requested="auto", compile_seconds=0.0, saving_seconds=0.0,
                             warm=warm, reason=f"auto: {reason}")

    if device_type != "cuda":
        return off("a CPU run stays eager, inductor's CPU compile being slow")
    if hardware == "cpu":
        return off("no GPU hardware profile to price the compile with (set hardware.name)")
    cost = WARM_COMPILE_SECONDS if warm else COLD_COMPILE_SECONDS
    per_step = train_seconds_per_step * COMPILED_TRAIN_SAVING
    saving = per_step * steps
    on = saving > cost
    cache = "the cache holds this layer shape" if warm else "a first compile"
    tokens = f" of {tokens_per_step:,.0f} tokens" if tokens_per_step else ""
    why = (f"auto: {steps} step(s) x {per_step:.2f} s saved ({COMPILED_TRAIN_SAVING:.0%} of "
           f"{train_seconds_per_step:.2f} s training{tokens}) = {saving:.1f} s "
           f"{'>' if on else '<='} {cost:.0f} s to compile ({cache})")
    return CompileChoice(on=on, requested="auto", compile_seconds=cost, saving_seconds=saving,
                         warm=warm, reason=why)


def choose_compile(cfg: Config, shape: ModelShape, hw: HardwareProfile, *, device_type: str,
                   warm: bool, tokens_per_card: float | None = None) -> CompileChoice:
    """price_compile for the run `cfg` on a `device_type` card priced with `hw`; each step
    trains `tokens_per_card` (None: the run's, run_train_tokens_per_card; `handoff plan`
    passes the tokens its modelled step trains, so both price the same step)."""
    tokens = run_train_tokens_per_card(cfg) if tokens_per_card is None else tokens_per_card
    seconds = train_seconds(shape, tokens, hw,
                            ref=cfg.actor.kl_coef > 0,
                            old_logprobs=cfg.actor.updates_per_step > 1,
                            lora=cfg.actor.lora.rank > 0)
    return price_compile(cfg.actor.compile, device_type=device_type, hardware=hw.name,
                         train_seconds_per_step=seconds, steps=cfg.run.steps, warm=warm,
                         tokens_per_step=tokens)


def compiled_rate(hw: HardwareProfile, choice: CompileChoice) -> HardwareProfile:
    """`hw` with the trainer's rate of compiled layers when `choice` turns them on (a GPU
    profile: the saving was measured on one); otherwise `hw` itself."""
    if not choice.on or hw.name == "cpu":
        return hw
    return dataclasses.replace(hw, train_flops_per_s=hw.train_flops_per_s
                               / (1 - COMPILED_TRAIN_SAVING))
