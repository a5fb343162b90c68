"""`handoff export` of a LoRA run: the adapter as PEFT saves it, or merged into the base.

    lora = run_lora(run_config, file)     # None: the run trained every parameter
    pairs = check_adapter(part.tensors, model_dir, lora, ckpt)   # {base weight: (A, B)}
    write_adapter(part, pairs, adapter_config(lora, model_dir), staging)   # --adapter
    weights = MergedWeights(model_dir, part, pairs, lora)   # else: written as a full part

A LoRA run (run_dir/config.json: actor.lora.rank > 0) checkpoints only its adapter in the
`model` part, named as the HF model's parameters once `peft.inject_adapter_in_model` added
the adapter "default": `model.layers.N.self_attn.q_proj.lora_A.default.weight` [r, in] and
`...lora_B.default.weight` [out, r], in the dtype the run trained; the base is the run's
model.path, as for a full export.

--adapter writes what `PeftModel.save_pretrained` would: adapter_model.safetensors with its
names (`base_model.model.model.layers.N....lora_A.weight`) and peft's own adapter_config.json
(r, lora_alpha, lora_dropout, target_modules, base_model_name_or_path, CAUSAL_LM).
Without it the adapter is merged: W' = W + (alpha / r) B A computed in fp32 and rounded once
to the trained dtype; every other base tensor is cast to that dtype, as the trainer loaded it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from handoff.config import ConfigError, LoraConfig, read_section
from handoff.errors import HandoffError
from handoff.model_files import weight_files
from handoff.safe_files import safetensors_os_errors, usual_mode

if TYPE_CHECKING:   # peft is imported where an adapter is written, with its own message
    from peft import LoraConfig as PeftLoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A LoRA run's checkpoint name (inject_adapter_in_model's, adapter "default").
_ADAPTER_NAME = re.compile(r"(model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])"
                           r"\.default\.weight")
_PROJECTION = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.weight")
_FIX_RUN = "export a checkpoint this LoRA run wrote, or restore the run's config.json"


class CheckpointTensors(Protocol):
    """What export.CheckpointPart offers: its checkpoint, meta tensors, and their values."""
    ckpt: Path
    tensors: dict[str, torch.Tensor]

    def load(self, names: list[str]) -> dict[str, torch.Tensor]: ...


def run_lora(run_config: dict, file: Path) -> LoraConfig | None:
    """The actor.lora of a run's config.json (`file`, read as `run_config`), checked as a
    config file's is; None when rank is 0 or absent: a full-parameter run."""
    actor = run_config.get("actor")
    lora = actor.get("lora") if isinstance(actor, dict) else None
    if not isinstance(lora, dict) or lora.get("rank", 0) == 0:
        return None
    try:
        return read_section(LoraConfig, lora, "actor.lora")
    except ConfigError as e:
        raise HandoffError(f"{file} records an actor.lora export cannot read ({e}): restore "
                           "the run's config.json") from None


def _base_index(model_dir: str) -> dict[str, tuple[Path, list[int]]]:
    """{name: (safetensors file, shape)} of the base model's weights (headers only)."""
    from safetensors import safe_open

    index = {}
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            index |= {name: (file, list(f.get_slice(name).get_shape())) for name in f.keys()}
    return index


def check_adapter(tensors: dict[str, torch.Tensor], model_dir: str, lora: LoraConfig,
                  ckpt: Path, *, fix: str | None = None) -> dict[str, tuple[str, str]]:
    """{base weight name: (lora_A name, lora_B name)}: every checkpoint tensor an adapter
    half of a targeted base projection at the run's rank, each with its other half, every
    targeted projection adapted, one dtype. `fix`: what the lines advise (default: another
    checkpoint, or the run's config.json restored)."""
    fix = fix or _FIX_RUN
    base = _base_index(model_dir)
    halves: dict[str, dict[str, str]] = {}
    for name, t in sorted(tensors.items()):
        match = _ADAPTER_NAME.fullmatch(name)
        weight = f"{match[1]}.weight" if match else None
        if match is None or match[2] not in lora.target_modules or weight not in base:
            raise HandoffError(f"checkpoint {ckpt} holds {name}, not a LoRA adapter tensor of "
                               f"the run's model ({model_dir}, target_modules "
                               f"{list(lora.target_modules)}): {fix}")
        out_features, in_features = base[weight][1]
        expected = [lora.rank, in_features] if match[3] == "A" else [out_features, lora.rank]
        if list(t.shape) != expected:
            raise HandoffError(f"checkpoint {ckpt}: {name} is {list(t.shape)}, the run's "
                               f"rank {lora.rank} on {weight} {base[weight][1]} needs "
                               f"{expected}: {fix}")
        halves.setdefault(weight, {})[match[3]] = name
    targeted = {n for n in base if (m := _PROJECTION.fullmatch(n))
                and m[1] in lora.target_modules}
    missing = sorted(targeted - set(halves)) + sorted(
        f"{w} (lora_{'B' if 'A' in h else 'A'})" for w, h in halves.items() if len(h) < 2)
    if missing:
        raise HandoffError(f"checkpoint {ckpt} lacks the adapter of {missing[0]} "
                           f"({len(missing)} missing): {fix}")
    if len({t.dtype for t in tensors.values()}) > 1:
        raise HandoffError(f"checkpoint {ckpt} holds adapter tensors of several dtypes: "
                           f"{fix}")
    return {weight: (h["A"], h["B"]) for weight, h in halves.items()}


def adapter_config(lora: LoraConfig, model_dir: str) -> PeftLoraConfig:
    """peft's LoraConfig of the run's adapter (built before anything is written)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise HandoffError("--adapter writes peft's adapter_config.json but peft is not "
                           "installed: pip install peft (or leave --adapter out to export "
                           "the merged model)") from None
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules),
                      base_model_name_or_path=str(Path(model_dir).resolve()),
                      task_type="CAUSAL_LM")


def save_tensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file; a failed write raised as the OSError it was."""
    from safetensors.torch import save_file

    with safetensors_os_errors(path):
        save_file(state, str(path), metadata={"format": "pt"})


def write_adapter(part: CheckpointTensors, pairs: dict[str, tuple[str, str]],
                  peft_config: PeftLoraConfig, staging: Path) -> None:
    """adapter_model.safetensors under save_pretrained's names, and adapter_config.json."""
    names = [n for pair in pairs.values() for n in pair]
    state = {f"base_model.model.{n.removesuffix('.default.weight')}.weight": t
             for n, t in part.load(names).items()}
    save_tensors(state, staging / ADAPTER_WEIGHTS)
    usual_mode(staging / ADAPTER_WEIGHTS)
    peft_config.save_pretrained(str(staging))


class MergedWeights:
    """The base's tensors with the adapter merged in, read as export.py reads a checkpoint
    part (`tensors`: meta tensors in the trained dtype; `load(names)`; `ckpt`), so the full
    export's writer shards and writes it."""

    def __init__(self, model_dir: str, part: CheckpointTensors,
                 pairs: dict[str, tuple[str, str]], lora: LoraConfig):
        self.ckpt, self.part, self.pairs = part.ckpt, part, pairs
        self.scale = lora.alpha / lora.rank
        self.dtype = next(iter(part.tensors.values())).dtype   # the trained dtype
        self.index = _base_index(model_dir)
        self.tensors = {name: torch.empty(shape, dtype=self.dtype, device="meta")
                        for name, (_, shape) in self.index.items()}

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """{name: merged (or cast) tensor on the host} for `names`."""
        from safetensors import safe_open

        adapter = self.part.load([n for w in names if w in self.pairs for n in self.pairs[w]])
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.index[name][0], []).append(name)
        out = {}
        for file, group in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in group:
                    weight = f.get_tensor(name)
                    if name in self.pairs:
                        a, b = (adapter[n].float() for n in self.pairs[name])
                        weight = weight.float() + self.scale * (b @ a)
                    out[name] = weight.to(self.dtype)
        return {name: out[name] for name in names}
