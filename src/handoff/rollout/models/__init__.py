"""Engine models: HF config.json -> DecoderSpec -> CausalLM, and safetensors checkpoint reading.

Supported `model_type`s: qwen3, qwen2, llama (one decoder with flags, see qwen3.py). Reading
is config-driven and uses safetensors directly, one tensor at a time, so a checkpoint never
needs a second copy in memory; the files are model_files.weight_files', the ones the trainer
loads, and config.json is checked by model_files first (architecture, sizes, heads).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import torch

from handoff.errors import HandoffError
from handoff.model_files import SUPPORTED_MODEL_TYPES, ModelFiles
from handoff.rollout.layers import adapter_rows
from handoff.rollout.models.qwen3 import CausalLM, DecoderSpec
from handoff.rollout.parallel import SINGLE, TPGroup


def spec_from_hf_config(hf: dict) -> DecoderSpec:
    """Check that the engine can run this config and extract what it needs."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HandoffError(f"model_type {model_type!r} is not supported by the built-in engine: use "
                           f"one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise HandoffError(f"hidden_act {hf['hidden_act']!r} is not supported: the engine runs "
                           "SiLU-gated MLPs only")
    if hf.get("use_sliding_window"):
        raise HandoffError("use_sliding_window=true is not supported: the engine attends to the "
                           "full context; set it to false in config.json")
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    return DecoderSpec(
        model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        qk_norm=model_type == "qwen3", qkv_bias=bias or model_type == "qwen2", o_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def eos_token_ids(files: ModelFiles) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json (chat models list several)."""
    return files.special_token_ids("eos_token_id")


def build_model(spec: DecoderSpec, *, device: torch.device, dtype: torch.dtype,
                tp: TPGroup = SINGLE, lora_max_rank: int | None = None) -> CausalLM:
    """This TP rank's parameters, uninitialised on `device` (fill them with load_weights,
    which takes full tensors), all views of ONE buffer: a memory region maps and unmaps one
    allocation instead of one per tensor (~40 us each way per allocation on the H200: ~17 ms
    per switch for a 4B model's ~400 tensors, see docs/PERF.md). With `lora_max_rank`, each
    decoder linear that can (layers.adapter_rows) gets that many rows of LoRA A right after
    its weight rows, so one GEMM computes x W^T and the adapter's x A^T (rollout/lora.py)."""
    model = CausalLM(spec, device=torch.device("meta"), dtype=dtype, tp=tp)
    if lora_max_rank:
        for name, module in model.named_modules():
            if name.startswith("model.layers.") and hasattr(module, "lora"):
                module.adapter_rows = adapter_rows(module, lora_max_rank)
    _place_in_one_buffer(model, device)
    return model


def _place_in_one_buffer(model: torch.nn.Module, device: torch.device, align: int = 256) -> None:
    """Replace every (meta) parameter by a view of one new uninitialised byte buffer."""
    owners = [(module, name, param) for module in model.modules()
              for name, param in module.named_parameters(recurse=False)]
    shapes, offsets, total = [], [], 0
    for module, name, param in owners:
        extra = getattr(module, "adapter_rows", 0) if name == "weight" else 0
        shapes.append((param.shape[0] + extra, *param.shape[1:]))
        offsets.append(total)
        total += -(-math.prod(shapes[-1]) * param.element_size() // align) * align
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for (module, name, param), shape, start in zip(owners, shapes, offsets):
        nbytes = math.prod(shape) * param.element_size()
        view = flat[start:start + nbytes].view(param.dtype).view(shape)
        placed = torch.nn.Parameter(view[:param.shape[0]], requires_grad=False)
        placed.__dict__.update(param.__dict__)  # shard_rules
        setattr(module, name, placed)
        if shape != param.shape:
            module.weight_and_adapter = view   # [weight rows; LoRA A rows], one GEMM's operand


def iter_checkpoint(model: str | Path | ModelFiles) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor in the checkpoint's weight_files (the ones the
    trainer loads; never a pickle)."""
    from safetensors import safe_open

    for path in ModelFiles.of(model).weights:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
