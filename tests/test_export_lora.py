"""`handoff export` of a LoRA run (export_lora.py) against peft, on tiny fp32 models (CPU).

A LoRA run's checkpoint is written here with the layout save_checkpoint gives it (the
adapter alone in the `model` part, under inject_adapter_in_model's names). --adapter must give
a directory PeftModel.from_pretrained loads to the run's logits; the merged export must load
in transformers with the logits of peft's own merge_and_unload; bad inputs are one line
before anything is written.
"""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.export import export_model
from handoff.modelzoo import init_model
from handoff.run_dir import write_run_config
from handoff.trainer.checkpoint_files import FORMAT, META, file_hashes, rng_state
from wrapped_text import flat

RANK, ALPHA = 4, 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.tensor([[1, 5, 9, 30, 2, 77, 4, 12], [3, 3, 8, 100, 61, 7, 0, 42]])



@pytest.fixture(scope="module", params=[("qwen3", ALL), ("llama", ["q_proj", "v_proj",
                                                                    "down_proj"])],
                ids=["qwen3-all", "llama-some"])
def lora_run(request, good, tmp_path_factory) -> dict:
    """A LoRA run over a tiny model (Qwen3: all seven projections; Llama: three), its
    checkpoint, and the in-memory model with the adapter it saved."""
    family, targets = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    base = good if family == "qwen3" else init_model("tiny-llama", root / "base",
                                                     dtype="float32")
    model = _adapted_model(base, targets)
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    run = _run_dir(root / "run", base, rank=RANK, targets=targets)
    _save_like_a_lora_run(run / "checkpoints", adapter, step=3)
    return {"base": base, "run": run, "model": model, "adapter": adapter, "targets": targets}


def _adapted_model(base, targets: list[str], dtype=torch.float32):
    """The HF model with peft's adapter "default" injected, as a LoRA run trains it, A and B
    drawn non-zero (peft starts B at zero)."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    model = inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                               target_modules=targets), model).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[1] ** 0.5)
    return model


def _run_dir(run, base, *, rank: int, targets: list[str], dtype: str = "float32"):
    cfg = load_config(None, [f"model.path={base}", f"model.dtype={dtype}",
                             f"run.out_dir={run}", f"actor.lora.rank={rank}",
                             f"actor.lora.alpha={ALPHA}",
                             f"actor.lora.target_modules=[{','.join(targets)}]"])
    run.mkdir(parents=True)
    write_run_config(cfg)
    return run


def _save_like_a_lora_run(root, model_part: dict[str, torch.Tensor], *, step: int) -> None:
    """Mirrors trainer/checkpoint.py save_checkpoint's layout for one rank: DCP files of
    {"model": the params it trains, "optim": their Adam state}, rng_rank0.json, meta.json
    with every file's sha256, then `latest` naming the directory."""
    name = f"step_{step:08d}_{uuid.uuid4().hex[:8]}"
    path = root / name
    optim = {f"{n}/{k}": torch.zeros_like(t) for n, t in model_part.items()
             for k in ("exp_avg", "exp_avg_sq")}
    with warnings.catch_warnings():   # one process, no process group: DCP warns
        warnings.simplefilter("ignore")
        dcp.save({"model": model_part, "optim": optim}, storage_writer=dcp.FileSystemWriter(
            path, single_file_per_rank=False))
    (path / "rng_rank0.json").write_text(json.dumps(rng_state(torch.device("cpu"))))
    meta = {"format": FORMAT, "step": step, "optimizer_step": step, "world_size": 1,
            "extra": {}, "model": {}, "files": file_hashes(path)}
    (path / META).write_text(json.dumps(meta))
    (root / "latest").write_text(name)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_the_adapter_export_loads_in_peft_with_the_runs_logits(lora_run, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = export_model(lora_run["run"], tmp_path / "adapter", adapter=True)
    assert {p.name for p in out.iterdir()} == {"adapter_config.json",
                                               "adapter_model.safetensors",
                                               "handoff_export.json"}
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert set(saved) == {"base_model.model." + n.replace(".default", "")
                          for n in lora_run["adapter"]}
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"], config["task_type"]) == (
        RANK, ALPHA, "LORA", "CAUSAL_LM")
    assert sorted(config["target_modules"]) == sorted(lora_run["targets"])
    assert config["base_model_name_or_path"] == str(Path(lora_run["base"]).resolve())   # any cwd
    record = json.loads((out / "handoff_export.json").read_text())
    assert record["step"] == 3 and record["lora"]["rank"] == RANK
    assert record["lora"]["merged"] is False

    base = AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32)
    base_logits = _logits(base)
    loaded = PeftModel.from_pretrained(base, str(out)).eval()
    logits = _logits(loaded)
    torch.testing.assert_close(logits, _logits(lora_run["model"]), rtol=0, atol=1e-6)
    assert (logits - base_logits).abs().max() > 1e-2   # the adapter changes the model


def test_the_merged_export_equals_pefts_merged_model(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = export_model(lora_run["run"], tmp_path / "adapter", adapter=True)
    out = export_model(lora_run["run"], tmp_path / "merged")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not (out / "adapter_config.json").exists()
    assert json.loads((out / "handoff_export.json").read_text())["lora"]["merged"] is True

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.dtype == torch.float32
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
    expected = reference.state_dict()
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(_logits(merged), _logits(reference), rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(merged), _logits(lora_run["model"]), rtol=0, atol=1e-5)


def test_a_bf16_run_is_merged_in_fp32_and_saved_in_bf16(good, tmp_path):
    from safetensors.torch import load_file

    model = _adapted_model(good, ["q_proj"], dtype=torch.bfloat16)
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    run = _run_dir(tmp_path / "run", good, rank=RANK, targets=["q_proj"], dtype="bfloat16")
    _save_like_a_lora_run(run / "checkpoints", adapter, step=1)
    out = export_model(run, tmp_path / "merged")
    merged = load_file(str(out / "model.safetensors"))
    base = load_file(str(good / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    name = "model.layers.1.self_attn.q_proj"
    a = adapter[f"{name}.lora_A.default.weight"].float()
    b = adapter[f"{name}.lora_B.default.weight"].float()
    in_fp32 = (base[f"{name}.weight"] + ALPHA / RANK * (b @ a)).bfloat16()
    assert torch.equal(merged[f"{name}.weight"], in_fp32)   # one rounding, at the end
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"].bfloat16())


def test_handoff_export_merged_then_generate(lora_run, tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app

    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", str(lora_run["run"]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert flat("LoRA adapter merged into the model") in flat(result.output)
    result = CliRunner().invoke(app, ["generate", "--model", str(out), "--prompt", "1+2=",
                                      "--max-tokens", "4", "--temperature", "0", "--json",
                                      "--no-chat"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)[0]["token_ids"]) == 4
    result = CliRunner().invoke(app, ["export", str(lora_run["run"]), "--out",
                                      str(tmp_path / "adapter"), "--adapter"])
    assert result.exit_code == 0, result.output
    assert flat("its LoRA adapter, for peft") in flat(result.output)


def test_an_adapter_export_over_a_merged_one_leaves_none_of_its_files(lora_run, tmp_path):
    """--overwrite replaces an earlier export's files, all of them (its record lists them):
    no merged model's config.json is left beside the adapter for a loader to take for a
    model, and `generate` names the directory a PEFT adapter. A file of the user's stays."""
    from typer.testing import CliRunner

    from handoff.cli import app

    out = tmp_path / "out"
    export_model(lora_run["run"], out)
    (out / "notes.txt").write_text("mine")
    merged = {p.name for p in out.iterdir()}
    export_model(lora_run["run"], out, adapter=True, overwrite=True)
    kept = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= merged and not kept & (merged - {
        "notes.txt", "handoff_export.json"})
    assert (out / "notes.txt").read_text() == "mine"
    assert kept == set(json.loads((out / "handoff_export.json").read_text())["files"]) | {
        "notes.txt"}
    (out / "config.json").write_text((lora_run["base"] / "config.json").read_text())  # by hand
    result = CliRunner().invoke(app, ["generate", "--model", str(out), "--prompt", "hi"])
    assert result.exit_code == 2 and "holds a PEFT adapter" in result.output
    assert "rename it" not in result.output


def _refused(run, out, match: str, **kwargs) -> None:
    with pytest.raises(HandoffError, match=match):
        export_model(run, out, **kwargs)
    assert not out.exists()   # every check runs before the first write


def test_lora_export_bad_inputs_are_one_line_and_write_nothing(lora_run, good, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    full = _run_dir(tmp_path / "full", good, rank=0, targets=ALL)
    _save_like_a_lora_run(full / "checkpoints", load_file(str(good / "model.safetensors")),
                          step=1)
    _refused(full, out, r"--adapter exports a LoRA adapter, but .* trained every parameter.*"
                        "leave --adapter out", adapter=True)

    # config.json says LoRA, the checkpoint holds full weights.
    edited = json.loads((full / "config.json").read_text())
    edited["actor"]["lora"]["rank"] = RANK
    (full / "config.json").write_text(json.dumps(edited))
    _refused(full, out, r"holds model.embed_tokens.weight, not a LoRA adapter tensor")

    config = json.loads((lora_run["run"] / "config.json").read_text())
    changes = [({"rank": 8}, r"the run's rank 8 on .* needs \[8, "),
               ({"target_modules": ["gate_proj"]}, "not a LoRA adapter tensor"),
               ({"rank": "four"}, "records an actor.lora export cannot read")]
    if lora_run["targets"] != ALL:   # the run claims projections its checkpoint never adapted
        changes.append(({"target_modules": ALL}, r"lacks the adapter of model\.layers\.0\."))
    for change, match in changes:
        run = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        (run / "checkpoints").symlink_to(lora_run["run"] / "checkpoints")
        lora = {**config["actor"]["lora"], **change}
        (run / "config.json").write_text(json.dumps({**config, "actor": {
            **config["actor"], "lora": lora}}))
        _refused(run, out, match)
        _refused(run, out, match, adapter=True)


def test_model_names_the_base_of_a_lora_run_and_is_checked_against_its_adapter(lora_run,
                                                                               tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    # The base elsewhere, the run's model.path relative (an older run's): --model names it.
    shutil.copytree(lora_run["base"], tmp_path / "base")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(lora_run["run"] / "checkpoints")
    config = json.loads((lora_run["run"] / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "model": {
        **config["model"], "path": "base"}}))
    _refused(run, tmp_path / "out", "records model.path='base', a relative path .* pass "
                                    "--model DIR", adapter=True)
    out = export_model(run, tmp_path / "adapter", adapter=True, model=str(tmp_path / "base"))
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert set(saved) == {"base_model.model." + n.replace(".default", "")
                          for n in lora_run["adapter"]}

    # A --model without a projection the adapter targets: its line advises --model.
    shutil.copytree(lora_run["base"], tmp_path / "other")
    weights = load_file(str(tmp_path / "other" / "model.safetensors"))
    del weights["model.layers.0.self_attn.q_proj.weight"]
    save_file(weights, str(tmp_path / "other" / "model.safetensors"), metadata={"format": "pt"})
    _refused(run, tmp_path / "out", "not a LoRA adapter tensor of the run's model .*: pass "
                                    "--model the base model this LoRA run trained",
             model=str(tmp_path / "other"))
