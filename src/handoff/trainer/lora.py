"""The actor's LoRA: peft adapters on the HF model, its base shared with the engine, the
adapters' tensors, and the base alone (the reference).

    inject_adapters(hf_model, cfg.actor.lora)          # A kaiming, B zeros: step 0 is the base
    share_base(hf_model, engine.export_weight, device=dev, dtype=torch.bfloat16)
    with adapters_disabled(hf_model): ...              # the reference: the base's log-probs
    dict(adapter_parameters(hf_model))                 # model.layers.N.self_attn.q_proj.lora_A.default.weight

Adapters are injected with `peft.inject_adapter_in_model` (not `get_peft_model`), so their
parameters keep the HF model's own names plus peft's `lora_A.default` / `lora_B.default`:
the names a LoRA checkpoint's `model` part holds and the engine's `load_adapter` takes. The
base layers peft wraps are renamed `<proj>.base_layer`; `hf_name` maps them back.

One copy of the base (actor.lora.share_base): every frozen base parameter becomes a view of
the engine's tensor for the same HF name (a fused q/k/v or gate/up weight's row block, the
embedding, the norms, the head), so the card holds the base once. peft wraps the HF Linear
and keeps its weight Parameter, so the Parameter's data is swapped in place (`.data`), which
keeps tied weights tied and peft's references valid; the trainer's own copy is then freed.
Neither side writes it: the engine's sync copies adapters only, the trainer's base is frozen.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from handoff.config import LoraConfig
from handoff.errors import HandoffError

ADAPTER = "default"      # peft's adapter name: part of every adapter parameter's name
_BASE_LAYER = ".base_layer."


def inject_adapters(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """peft's LoRA layers on `lora.target_modules` of every decoder layer, initialised as peft
    does (from torch's RNG: the run's seed); only the adapters train."""
    import peft

    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules))
    model = peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The HF checkpoint's name of a base parameter of the injected model."""
    return name.replace(_BASE_LAYER, ".")


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every adapter tensor, in module order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


def share_base(model: torch.nn.Module, engine_tensor: Callable[[str], torch.Tensor], *,
               device: torch.device, dtype: torch.dtype) -> None:
    """Make every base parameter a view of `engine_tensor(HF name)` (the engine's copy) and
    move the rest (adapters, buffers) to `device`; the trainer's own copy (loaded on the
    host) is freed. Refuses an engine of another dtype or device, or a tensor of another
    shape, in one line, before anything is swapped."""
    views = []
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        view = engine_tensor(hf_name(name)).detach()
        where = f"the engine's {hf_name(name)} is {view.dtype} on {view.device}"
        if view.dtype != dtype or view.device.type != device.type or (
                device.index is not None and view.device != device):
            raise HandoffError(f"actor.lora.share_base: {where}, the trainer's {dtype} on "
                               f"{device}: build both with model.dtype and run.device, or set "
                               "actor.lora.share_base=false")
        if view.shape != param.shape:
            raise HandoffError(f"actor.lora.share_base: {where} of shape {tuple(view.shape)}, "
                               f"the trainer's {tuple(param.shape)}: the engine does not hold "
                               "the whole tensor (parallel.tp > 1?); set "
                               "actor.lora.share_base=false")
        views.append((param, view))
    for param, view in views:
        param.data = view
    model.to(device)   # the views are on `device` already: moved are the adapters and buffers


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base alone: peft's disabled-adapter switch on every LoRA layer, then back on
    (which makes the adapters trainable again, as they were)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise HandoffError("adapters_disabled on a model without LoRA layers: the reference of "
                           "a full-parameter run is its own model (build_reference)")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
