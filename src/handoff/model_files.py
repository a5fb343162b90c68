"""Checks of an HF checkpoint directory before anything loads it (no torch here).

    check_model_dir("ckpt/", flag="model.path")    # config, architecture, tokenizer, weights
    files = ModelFiles.open("ckpt/")                # read and checked once: what both sides load
    files = weight_files("ckpt/")                  # the safetensors both sides load
    cap_context(cfg)                               # max_model_len within the model's positions
    tokenizer = load_tokenizer("ckpt/")            # transformers', never custom code
    check_loading_info("ckpt/", info)              # after transformers' from_pretrained

A weights file cut short (a copy that stopped, a full disk) or a config.json that does not
describe the weights should be one line naming the file, not a loader's traceback, and
never a model that trains from a random tensor: transformers fills a missing tensor with a
fresh init and carries on, so the trainer checks what it reports.

A model directory is data, never code: only safetensors are read (a pickle weight file,
`pytorch_model.bin`, is never opened), and a config naming custom code (`auto_map`) or an
architecture the engine does not run is refused before transformers could offer to run it.
The trainer and the engine read the one list `weight_files` returns, the files transformers
loads with use_safetensors=True, in its order: model.safetensors, else the index's shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from handoff.errors import HandoffError, refuse_empty
from handoff.reading import expect, parse_json, read_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHTS_INDEX = "model.safetensors.index.json"   # a sharded checkpoint's map of its shards
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")   # the engine's decoders (rollout/models)
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit on its JSON header
_MAX_CONFIG_BYTES = 4 << 20     # a config.json is a few kB
_ADAPTER_FIX = ("point it at the adapter's base model (adapter_config.json names it), or "
                "`handoff export RUN --out DIR` without --adapter for a merged model")
_CONVERT = ("convert it once on a machine you trust with transformers: "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, "
            "safe_serialization=True)")


def read_model_config(path: str | Path, *, flag: str = "--model") -> dict:
    """config.json of a checkpoint directory as a dict, or one line naming what is wrong."""
    refuse_empty(path, flag, "a model directory")
    file = Path(path) / "config.json"
    if not file.is_file():
        refuse_not_a_model(path, None, flag=flag)
        raise HandoffError(f"{flag}={str(path)!r} is not an HF checkpoint directory (no "
                           "config.json): create one with `handoff init-model --preset "
                           "tiny-qwen3 --out DIR` or point it at a downloaded model")
    config = read_json(file, max_bytes=_MAX_CONFIG_BYTES)
    refuse_not_a_model(path, config, flag=flag)
    return config


def refuse_not_a_model(path: str | Path, config: dict | None, *, flag: str) -> None:
    """One line for a directory given as a model that is a PEFT adapter's (no config.json:
    `config` None) or a handoff run's (its config.json `config` is the run's)."""
    if config is None and (Path(path) / "adapter_config.json").is_file():
        raise HandoffError(f"{flag}={str(path)!r} is a PEFT adapter directory, not a model: "
                           f"{_ADAPTER_FIX}")
    if is_run_config(config):
        raise HandoffError(f"{flag}={str(path)!r} is a handoff run directory, not a model: "
                           f"`handoff export {path} --out DIR` writes its model, then point "
                           f"{flag} at DIR")


def refuse_a_run(out: Path, *, writes: str) -> None:
    """One line for an --out that holds a handoff run (its config.json is a run's): `writes`
    (a model, an export) would replace that config.json and mix with its files."""
    if not (out / "config.json").is_file():
        return
    try:
        record = read_json(out / "config.json", max_bytes=_MAX_CONFIG_BYTES)
    except (HandoffError, OSError):   # not a readable config: not a run's either
        return
    if is_run_config(record):
        raise HandoffError(f"--out {str(out)!r} holds a handoff run: {writes} never goes into "
                           "a run's directory, even with --overwrite; pass another directory")


def is_run_config(data) -> bool:
    """Whether `data` (a parsed config.json) is a handoff run's config, not a model's."""
    return (isinstance(data, dict) and {"model", "run", "rollout", "actor"} <= data.keys()
            and isinstance(data["model"], dict) and "path" in data["model"])


def check_architecture(path: str | Path, config: dict) -> None:
    """Refuse custom model code (`auto_map`) and any architecture the engine does not run,
    before transformers sees the directory (it would ask whether to run the code)."""
    model = Path(path)
    fix = (f"handoff runs {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints with its own code "
           "and never runs a model's code: point it at a supported checkpoint")
    for name in ("config.json", "tokenizer_config.json"):
        file = model / name
        data = config if name == "config.json" else (
            read_json(file, max_bytes=_MAX_CONFIG_BYTES << 4) if file.is_file() else {})
        if "auto_map" in data:
            raise HandoffError(f"{file} names custom code (auto_map): that architecture is not "
                               f"supported; {fix}")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HandoffError(f"{model / 'config.json'}: architecture model_type={model_type!r} is "
                           f"not supported; {fix}")
    archs = expect(config, "architectures", list, source=str(model / "config.json"), default=[])
    bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if bad:
        raise HandoffError(f"{model / 'config.json'}: architecture {bad[0]!r} is not "
                           f"supported; {fix}")


def check_shape(path: str | Path, config: dict) -> None:
    """The sizes config.json gives are whole positive numbers and the heads divide."""
    src = str(Path(path) / "config.json")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        expect(config, key, int, source=src, lo=1)
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        expect(config, key, int, source=src, lo=1, default=None)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise HandoffError(f"{src}: num_attention_heads={heads} is not a multiple of "
                           f"num_key_value_heads={kv_heads} (each KV head serves a whole group "
                           "of query heads): restore the checkpoint's config.json")
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        raise HandoffError(f"{src}: hidden_size={config['hidden_size']} does not divide into "
                           f"num_attention_heads={heads} heads and no head_dim is given: restore "
                           "the checkpoint's config.json")


def _tokenizer_ids(model: Path) -> tuple[int, str]:
    """(largest token id, where it is) of tokenizer.json and tokenizer_config.json."""
    best = (-1, "")
    file = model / "tokenizer.json"
    if file.is_file():
        data = read_json(file)
        vocab = data.get("model", {}).get("vocab") if isinstance(data.get("model"), dict) else None
        if isinstance(vocab, dict):       # BPE, WordPiece: {token: id}
            ids = [v for v in vocab.values() if isinstance(v, int)]
        elif isinstance(vocab, list):     # Unigram: [[token, score], ...] by id
            ids = [len(vocab) - 1]
        else:
            ids = []
        best = max(best, (max(ids, default=-1), f"{file} (model.vocab)"))
        added = [t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)]
        best = max(best, (max((i for i in added if isinstance(i, int)), default=-1),
                          f"{file} (added_tokens)"))
    file = model / "tokenizer_config.json"
    if file.is_file():
        decoder = read_json(file, max_bytes=_MAX_CONFIG_BYTES << 4).get("added_tokens_decoder")
        if isinstance(decoder, dict):
            ids = [int(k) for k in decoder if str(k).isdigit() and len(str(k)) < 12]
            best = max(best, (max(ids, default=-1), f"{file} (added_tokens_decoder)"))
    return best


def check_tokenizer_ids(path: str | Path, config: dict) -> None:
    """Every id the tokenizer can produce, and the special ids config.json and
    generation_config.json name, index a row of the model's embedding (vocab_size)."""
    model = Path(path)
    vocab = config["vocab_size"]
    fix = "the tokenizer is not this model's: save the model's own tokenizer next to it"
    top, where = _tokenizer_ids(model)
    if top >= vocab:
        raise HandoffError(f"{where} has token id {top}, past the model's vocab_size={vocab} "
                           f"(config.json): {fix}")
    gen = model / "generation_config.json"
    sources = [(model / "config.json", config)] + (
        [(gen, read_json(gen, max_bytes=_MAX_CONFIG_BYTES))] if gen.is_file() else [])
    for file, data in sources:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = data.get(key)
            for i in value if isinstance(value, list) else [value]:
                if i is None:
                    continue
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                    raise HandoffError(f"{file}: {key}={i!r} is not a token id of the model's "
                                       f"vocab_size={vocab}: {fix}")


def special_token_ids(path: str | Path, config: dict, key: str) -> frozenset[int]:
    """The ids config.json and generation_config.json give `key` (e.g. eos_token_id; chat
    models list several), checked as check_tokenizer_ids checks them."""
    model = Path(path)
    gen = model / "generation_config.json"
    ids: set[int] = set()
    for data in [config] + ([read_json(gen, max_bytes=_MAX_CONFIG_BYTES)] if gen.is_file() else []):
        value = data.get(key)
        ids |= {i for i in (value if isinstance(value, list) else [value])
                if isinstance(i, int) and not isinstance(i, bool)}
    return frozenset(ids)


def _refuse_dangling(path: Path) -> None:
    """A weights file that is a link to nothing: an HF cache snapshot whose blob was deleted."""
    if path.is_symlink() and not path.exists():
        raise HandoffError(f"{path} is a symbolic link to a missing file "
                           f"({os.readlink(path)}): re-download or copy the weights")


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, as transformers loads them with
    use_safetensors=True: model.safetensors, else the shards of model.safetensors.index.json.
    Pickle weights are never opened; other names are refused rather than guessed at."""
    model = Path(path)
    single, index = model / "model.safetensors", model / WEIGHTS_INDEX
    if single.is_file():
        return [single]
    _refuse_dangling(single)
    if index.is_file():
        weight_map = expect(read_json(index), "weight_map", dict, source=str(index))
        files = []
        for name in sorted(set(weight_map.values())):
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise HandoffError(f"{index} lists {name!r}, not a file name in {model}: "
                                   "restore the index from the checkpoint")
            _refuse_dangling(model / name)
            if not (model / name).is_file():
                raise HandoffError(f"{model / name} is missing (listed in {index.name}): copy "
                                   "the whole checkpoint")
            files.append(model / name)
        if not files:
            raise HandoffError(f"{index} lists no weights: restore it from the checkpoint")
        return files
    others = sorted(model.glob("*.safetensors"))
    if (model / "adapter_config.json").is_file():   # a config.json beside it is not its own
        raise HandoffError(f"{str(model)!r} holds a PEFT adapter (adapter_config.json), not a "
                           f"model's weights: {_ADAPTER_FIX}")
    if others:
        raise HandoffError(f"{others[0]} is not a name transformers loads (model.safetensors or "
                           "the shards of model.safetensors.index.json): rename it to "
                           "model.safetensors (one file) or write the index")
    pickles = sorted(p.name for p in model.iterdir() if p.suffix in PICKLE_SUFFIXES) \
        if model.is_dir() else []
    if pickles:
        raise HandoffError(f"{model} holds pickle weights only ({pickles[0]}), which handoff "
                           f"never opens (unpickling can run code): {_CONVERT}")
    raise HandoffError(f"{model} has no *.safetensors weights: handoff loads safetensors "
                       "checkpoints only (save with safe_serialization=True)")


@dataclass(frozen=True)
class ModelFiles:
    """A model directory read and checked once: its config.json (a supported architecture
    whose heads divide) and the safetensors files `weight_files` names. A run opens it once
    and hands it to the trainer and the engine, so both load these very files."""

    path: Path
    config: dict
    weights: tuple[Path, ...]

    @classmethod
    def open(cls, path: str | Path, *, flag: str = "--model") -> "ModelFiles":
        config = read_model_config(path, flag=flag)
        check_architecture(path, config)
        check_shape(path, config)
        return cls(Path(path), config, tuple(weight_files(path)))

    @classmethod
    def of(cls, model: "str | Path | ModelFiles") -> "ModelFiles":
        """`model` itself, or the directory it names opened."""
        return model if isinstance(model, ModelFiles) else cls.open(model)

    def special_token_ids(self, key: str) -> frozenset[int]:
        return special_token_ids(self.path, self.config, key)


def check_safetensors(file: Path) -> None:
    """Raise unless the file's header parses and its data is all there."""
    size = file.stat().st_size
    fix = "copy the checkpoint again (or re-create it with `handoff init-model`)"
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER_BYTES):
            raise HandoffError(f"{file} is truncated or not a safetensors file ({size} bytes, "
                               f"no complete header): {fix}")
        try:
            header = parse_json(f.read(n), source=f"{file}'s header")
            end = max((int(v["data_offsets"][1]) for k, v in header.items()
                       if k != "__metadata__"), default=0)
        except (HandoffError, KeyError, TypeError, ValueError, AttributeError, IndexError):
            raise HandoffError(f"{file} has a damaged safetensors header: {fix}") from None
    if 8 + n + end > size:
        raise HandoffError(f"{file} is truncated: its header describes {8 + n + end} bytes, the "
                           f"file has {size}: {fix}")


def check_model_dir(path: str | Path, *, flag: str = "--model", tokenizer: bool = True) -> None:
    """config.json readable and of a supported architecture whose heads divide, the
    tokenizer's files present with ids inside the vocabulary, every weights file complete."""
    config = read_model_config(path, flag=flag)
    check_architecture(path, config)
    check_shape(path, config)
    model = Path(path)
    files = weight_files(model)   # first: a PEFT adapter's directory is named as one
    if tokenizer and not any((model / name).is_file() for name in TOKENIZER_FILES):
        raise HandoffError(f"{model} has no tokenizer files ({' or '.join(TOKENIZER_FILES)}): "
                           "save the tokenizer next to the weights "
                           "(tokenizer.save_pretrained(DIR))")
    check_tokenizer_ids(path, config)
    for file in files:
        check_safetensors(file)


def load_tokenizer(path: str | Path):
    """transformers' tokenizer of a checked model directory; custom tokenizer code is never
    run (trust_remote_code=False, and check_architecture refused an auto_map before)."""
    from transformers import AutoTokenizer

    check_architecture(path, read_model_config(path))
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as e:
        said = " ".join(str(e).split())[:200]   # transformers' messages span lines
        raise HandoffError(f"cannot load a tokenizer from {str(path)!r} ({said}): pass an HF "
                           "checkpoint directory with tokenizer files") from None


def cap_context(cfg) -> None:
    """Lower rollout.max_model_len to the model's max_position_embeddings, with a warning
    (the engine would cap it anyway, silently); refuse a max_tokens that leaves no prompt."""
    ro = cfg.rollout
    positions = int(read_model_config(cfg.model.path, flag="model.path")
                    .get("max_position_embeddings", 4096))
    if ro.max_model_len > positions:
        if os.environ.get("RANK", "0") == "0":
            from rich.console import Console

            Console(stderr=True).print(
                f"[yellow]warning: rollout.max_model_len={ro.max_model_len} is above the "
                f"model's max_position_embeddings={positions}: capped at {positions}[/]",
                highlight=False)
        ro.max_model_len = positions
    if ro.max_tokens >= ro.max_model_len:
        raise HandoffError(f"rollout.max_tokens={ro.max_tokens} leaves no room for a prompt in "
                           f"the model's {ro.max_model_len} positions (max_position_embeddings): "
                           "lower rollout.max_tokens")


def check_loading_info(path: str | Path, info: dict) -> None:
    """Raise on a tensor transformers found with the wrong shape, or did not find at all."""
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        name, found, expected = mismatched[0]
        raise HandoffError(f"{path}: tensor {name} has shape {tuple(found)}, its config.json "
                           f"makes it {tuple(expected)} ({len(mismatched)} such tensor(s)): the "
                           "weights and config.json disagree; restore the checkpoint")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise HandoffError(f"{path} lacks tensor {missing[0]} ({len(missing)} missing): the "
                           "weights do not match config.json; restore the checkpoint")
