"""`handoff export`: a tiny run's checkpoint out as a Hugging Face model (CPU).

The exported directory must load in transformers, hold exactly the tensors the trainer
saved, and give the engine's greedy completions; bad inputs get one line and lose nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import handoff.export
import handoff.loop
from handoff.api import train
from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.export import export_model
from handoff.modelzoo import init_model
from handoff.rollout.cli_generate import generate_samples

PROMPTS = ["1+2=", "hello", "What is 7*8?", "abc", "The cat"]


def _lively_model(out, *, tied: bool):
    """tiny-qwen3 with unit-gain weights: init_model's std 0.02 repeats one token forever,
    which any engine would match. Untied: an lm_head of its own in config and weights."""
    init_model("tiny-qwen3", out, dtype="float32")
    state = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    if not tied:
        state["lm_head.weight"] = torch.empty_like(state["model.embed_tokens.weight"])
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    for name, value in state.items():
        if value.dim() == 2:
            state[name] = torch.randn(value.shape, generator=gen) * 1.5 / value.shape[1] ** 0.5
    state["model.embed_tokens.weight"][256:260] *= 0.05   # EOS and friends rarely chosen
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _train(root, *, tied: bool) -> dict:
    """A two-step run checkpointed at both steps, and the actor's params at each save."""
    model_dir = _lively_model(root / "model", tied=tied)
    saved = {}

    def recording_save(ckpt_dir, actor, *, step, **kwargs):
        saved[step] = {n: p.detach().full_tensor().clone()
                       for n, p in actor.module.named_parameters()}
        return plain_save(ckpt_dir, actor, step=step, **kwargs)

    def varied_rewards(prompts, completions, **columns):
        # A random model never solves the task: all-zero rewards would leave the weights as
        # they were. Any reward that varies within a group makes the update move them.
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [float(sum(t.encode()) % 3) for t in texts]

    plain_save = handoff.loop.save_checkpoint
    cfg = load_config("examples/cpu-tiny.yaml", [f"model.path={model_dir}",
                                                  f"run.out_dir={root / 'run'}",
                                                  "run.save_every=1", "run.steps=2"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(handoff.loop, "save_checkpoint", recording_save)
        train(cfg, reward_funcs=[varied_rewards])
    return {"model": model_dir, "run": root / "run", "saved": saved, "tied": tied}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(tied) -> the trained run of that head layout, trained once per module."""
    done = {}

    def get(tied: bool) -> dict:
        if tied not in done:
            done[tied] = _train(tmp_path_factory.mktemp("export"), tied=tied)
        return done[tied]

    return get


@pytest.fixture
def trained(runs):
    return runs(True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_export_loads_in_transformers_and_gives_the_engines_greedy_completions(runs, tied,
                                                                                  tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = runs(tied)

    out = export_model(trained["run"], tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "handoff_export.json"} <= names
    assert json.loads((out / "handoff_export.json").read_text())["step"] == 2
    weights = load_file(str(out / "model.safetensors"))
    final = trained["saved"][2]
    # The trained tensors exactly, the tied head left for transformers to tie.
    assert ("lm_head.weight" in weights) == (not trained["tied"])
    assert set(weights) == set(final)
    assert all(torch.equal(weights[n], final[n]) for n in final)
    start = load_file(str(trained["model"] / "model.safetensors"))
    assert any(not torch.equal(weights[n], start[n]) for n in weights)   # training moved them
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.float32
    if trained["tied"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(out)
    engine = generate_samples(str(out), PROMPTS, max_tokens=12, temperature=0.0, chat=False,
                              device="cpu")
    assert len(engine) == len(PROMPTS)
    for prompt, sample in zip(PROMPTS, engine):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert sample["prompt_token_ids"] == ids
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert sample["token_ids"] == hf[0, len(ids):].tolist(), prompt
    assert any(len(set(s["token_ids"])) > 2 for s in engine)   # not one token repeated


def test_step_picks_an_earlier_checkpoint(trained, tmp_path):
    out = export_model(trained["run"], tmp_path / "hf", step=1)
    weights = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(weights[n], t) for n, t in trained["saved"][1].items())
    assert any(not torch.equal(weights[n], t) for n, t in trained["saved"][2].items())
    assert json.loads((out / "handoff_export.json").read_text())["step"] == 1


def test_export_bad_inputs_are_one_line_and_lose_nothing(trained, tmp_path):
    run = trained["run"]
    with pytest.raises(HandoffError, match=r"no complete checkpoint of step 7: it keeps steps "
                                           r"\[1, 2\]"):
        export_model(run, tmp_path / "a", step=7)
    with pytest.raises(HandoffError, match="--step -1 is negative"):
        export_model(run, tmp_path / "a", step=-1)

    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    (empty_run / "config.json").write_text((run / "config.json").read_text())
    with pytest.raises(HandoffError, match="has no complete checkpoint"):
        export_model(empty_run, tmp_path / "a")
    with pytest.raises(HandoffError, match="not a handoff run directory"):
        export_model(tmp_path / "nowhere", tmp_path / "a")
    assert not (tmp_path / "a").exists()   # refused before anything was written

    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(HandoffError, match=r"already holds files \(notes.txt\): pass "
                                           "--overwrite"):
        export_model(run, used)
    assert [p.name for p in used.iterdir()] == ["notes.txt"]   # nothing written, nothing lost
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(HandoffError, match="is a file, not a directory"):
        export_model(run, tmp_path / "a-file")
    (tmp_path / "link").symlink_to(used)
    with pytest.raises(HandoffError, match="is a symbolic link"):
        export_model(run, tmp_path / "link")

    # --overwrite into the run itself, below it or above it: its config.json and checkpoints
    # would be replaced (the next export of the run would then fail)
    files = {p: p.read_bytes() for p in run.rglob("*")
             if p.is_file() and p.name != ".handoff.lock"}
    for out, where in ((run, "is the run directory"), (run / "exported", "is inside the run"),
                       (run.parent, "is a directory that holds the run directory")):
        with pytest.raises(HandoffError, match=where):
            export_model(run, out, overwrite=True)
    assert {p: p.read_bytes() for p in files} == files and not (run / "exported").exists()

    # --overwrite into another run's directory: its config.json would become the model's, and
    # that run could no longer be exported or resumed (a tester's find)
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "config.json").write_text((run / "config.json").read_text())
    (other / "metrics.jsonl").write_text("{}\n")
    kept = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(HandoffError, match="holds a handoff run: an export never goes into"):
        export_model(run, other, overwrite=True)
    assert {p.name: p.read_bytes() for p in other.iterdir()} == kept

    # --out the model the run trained (its model.path), or inside it: the base would be
    # replaced, and a LoRA run's next merged export would add its adapter to it again
    model = Path(json.loads((run / "config.json").read_text())["model"]["path"])
    weights = {p: p.read_bytes() for p in model.rglob("*") if p.is_file()}
    for out, overwrite in ((model, False), (model, True), (model / "exported", True)):
        with pytest.raises(HandoffError, match="model directory the run trained"):
            export_model(run, out, overwrite=overwrite)
    assert {p: p.read_bytes() for p in weights} == weights
    assert not (model / "exported").exists()


def test_overwrite_replaces_the_export_and_never_writes_through_a_link(trained, tmp_path,
                                                                        monkeypatch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    # First a sharded export (HF's index beside the shards), loaded by transformers whole.
    monkeypatch.setattr(handoff.export, "MAX_SHARD_BYTES", 60_000)
    export_model(trained["run"], out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and sorted(p.name for p in out.glob("*.safetensors")) == shards
    model = AutoModelForCausalLM.from_pretrained(out)
    final = trained["saved"][2]
    assert all(torch.equal(model.state_dict()[n], t) for n, t in final.items())

    outside = tmp_path / "outside.json"
    outside.write_text("keep me")
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(outside)           # a planted link out of --out
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(handoff.export, "MAX_SHARD_BYTES", 5 * 10**9)
    export_model(trained["run"], out, overwrite=True)
    assert outside.read_text() == "keep me"
    assert not (out / "config.json").is_symlink()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    # The old shards and index are gone (a loader would read them beside the new file).
    assert [p.name for p in out.glob("*.safetensors*")] == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / ".handoff-export.tmp").exists()


def test_handoff_export_then_generate_from_a_prompt_file(trained, tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app

    out = tmp_path / "hf"
    result = CliRunner().invoke(app, ["export", str(trained["run"]), "--out", str(out),
                                      "--step", "1"])
    assert result.exit_code == 0, result.output
    assert "step 1" in result.output and json.loads(
        (out / "handoff_export.json").read_text())["step"] == 1
    # the weights readable as the other files are (safetensors creates its files 0600)
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in PROMPTS))
    result = CliRunner().invoke(app, ["generate", "--model", str(out), "--prompt-file",
                                      str(prompts), "--max-tokens", "4", "--temperature", "0",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert [s["prompt"] for s in json.loads(result.stdout)] == PROMPTS
    # A used --out: one line, exit 2, nothing touched.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = CliRunner().invoke(app, ["export", str(trained["run"]), "--out", str(out)])
    assert result.exit_code == 2 and "pass --overwrite" in result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ---------------------------------------------------------------- a live run, a damaged step


def _copy_run(trained, tmp_path):
    """The trained run copied, free to prune or damage."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run, ignore=shutil.ignore_patterns(".handoff.lock"))
    return run


def _prune(ckpt):
    """What a live run's prune does: rename the directory away whole, then delete it."""
    import shutil

    trash = ckpt.parent / f".trash_{ckpt.name}"
    ckpt.rename(trash)
    shutil.rmtree(trash)


def _steps(run):
    return {int(p.name.split("_")[1]): p for p in (run / "checkpoints").glob("step_*")}


def test_a_checkpoint_pruned_while_export_reads_it_says_so_and_lists_the_kept_steps(
        trained, tmp_path, monkeypatch):
    import handoff.trainer.checkpoint_files as checkpoint_files

    run = _copy_run(trained, tmp_path)
    out = tmp_path / "hf"
    # `latest` read, then the run saved step 3 elsewhere and pruned the step latest named.
    (run / "checkpoints" / "latest").write_text("step_00000003_gone")
    with pytest.raises(HandoffError) as e:
        export_model(run, out)
    said = str(e.value)
    assert "names step_00000003_gone, which is gone" in said
    assert "run the export again, or pass --step N of a kept checkpoint (kept steps: [1, 2])" \
        in said
    assert "--overwrite" not in said and "\n" not in said and not out.exists()

    # Pruned after `latest` was read, while its files are being verified.
    (run / "checkpoints" / "latest").write_text(_steps(run)[2].name)
    verify = checkpoint_files.verify_files

    def pruned_then_verified(directory, recorded):
        _prune(directory)
        return verify(directory, recorded)

    monkeypatch.setattr(handoff.export, "verify_files", pruned_then_verified)
    with pytest.raises(HandoffError) as e:
        export_model(run, out)
    said = str(e.value)
    assert "was removed while export read it (the run is still saving and pruning" in said
    assert "pass --step N of a kept checkpoint (kept steps: [1])" in said
    assert "--overwrite" not in said and not out.exists()
    monkeypatch.undo()

    # Pruned while its weights are read (DCP opens the shards), --step 1, into a new --out.
    load = handoff.export.dcp.load

    def pruned_then_loaded(*args, **kwargs):
        _prune(_steps(run)[1])
        return load(*args, **kwargs)

    monkeypatch.setattr(handoff.export.dcp, "load", pruned_then_loaded)
    with pytest.raises(HandoffError) as e:
        export_model(run, tmp_path / "new" / "hf", step=1)
    said = str(e.value)
    assert "was removed while export read it" in said and "kept steps: none" in said
    assert "--overwrite" not in said
    assert not (tmp_path / "new").exists()   # the directories it made went with it


def test_a_damaged_checkpoint_names_another_step_to_export_not_a_resumes_fix(trained,
                                                                            tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app

    run = _copy_run(trained, tmp_path)
    newest = _steps(run)[2]
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])   # cut short
    result = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "hf")],
                                terminal_width=1000)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"checkpoint {newest} cannot be exported: {shard} does not match the sha256" \
        in lines[0]
    assert lines[0].endswith("pass --step N of another checkpoint (kept steps: [1])")
    assert "--overwrite" not in lines[0] and "point `latest`" not in lines[0]
    assert not (tmp_path / "hf").exists()
    # the fix it names works
    export_model(run, tmp_path / "hf", step=1)
    assert json.loads((tmp_path / "hf" / "handoff_export.json").read_text())["step"] == 1
    # `latest` gone: the kept steps named (export takes no stand-in: the user picks)
    latest = (run / "checkpoints" / "latest").read_bytes()
    (run / "checkpoints" / "latest").unlink()
    with pytest.raises(HandoffError, match=r"latest is missing .*: pass --step N of a kept "
                                           r"checkpoint \(kept steps: \[1, 2\]\)"):
        export_model(run, tmp_path / "hf3")
    (run / "checkpoints" / "latest").write_bytes(latest)
    # a meta.json edited by hand (its step): the same kind of line, export's own fix
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(json.dumps({**meta, "step": 7}))
    with pytest.raises(HandoffError) as e:
        export_model(run, tmp_path / "hf2")
    assert str(e.value) == (f"checkpoint {newest} cannot be exported: {newest / 'meta.json'} "
                            "records step 7 but its directory was saved at step 2: meta.json "
                            "was edited by hand; pass --step N of another checkpoint (kept "
                            "steps: [1])")


# ---------------------------------------------------------------- the run's model.path


def _recorded(run, path):
    """The run's config.json with model.path set to `path` (as an older run recorded it)."""
    config = json.loads((run / "config.json").read_text())
    config["model"]["path"] = path
    (run / "config.json").write_text(json.dumps(config))


def test_a_relative_model_path_is_not_looked_up_in_the_current_directory(
        trained, tmp_path, monkeypatch):
    import shutil

    from typer.testing import CliRunner

    from handoff.cli import app

    run = _copy_run(trained, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))   # empty: no Hub model cached
    # An unrelated model of the same shapes where the relative path points from here.
    init_model("tiny-qwen3", tmp_path / "models" / "tiny", dtype="float32")
    _recorded(run, "models/tiny")
    with pytest.raises(HandoffError) as e:
        export_model(run, tmp_path / "hf")
    said = str(e.value)
    assert "records model.path='models/tiny', a relative path" in said
    assert "does not look it up in the current directory" in said
    assert said.endswith("pass --model DIR, the model directory the run trained (checked "
                         "against the checkpoint)")
    assert not (tmp_path / "hf").exists()
    # Not here either: a Hub id missing from the cache, or an older run's directory.
    shutil.rmtree(tmp_path / "models")
    with pytest.raises(HandoffError) as e:
        export_model(run, tmp_path / "hf")
    said = str(e.value)
    assert "not in the local Hugging Face cache" in said and "pass --model DIR" in said
    for path in ("./models/tiny", "tiny-model", "../runs/models/x/y"):
        _recorded(run, path)
        with pytest.raises(HandoffError, match="a relative path .* pass --model DIR"):
            export_model(run, tmp_path / "hf")
    _recorded(run, str(tmp_path / "moved"))   # an absolute path that has gone since
    with pytest.raises(HandoffError, match="which does not exist .*: pass --model DIR"):
        export_model(run, tmp_path / "hf")

    # --model names it (a relative --model is the user's own, read from here).
    shutil.copytree(trained["model"], tmp_path / "trained-model")
    result = CliRunner().invoke(app, ["export", str(run), "--out", "hf", "--model",
                                      "trained-model"])
    assert result.exit_code == 0, result.output
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(weights[n], t) for n, t in trained["saved"][2].items())
    done = json.loads((tmp_path / "hf" / "handoff_export.json").read_text())
    assert done["model"] == str(tmp_path / "trained-model")
    # --model is checked against the checkpoint as model.path is.
    init_model("tiny-llama", tmp_path / "llama", dtype="float32")
    result = CliRunner().invoke(app, ["export", str(run), "--out", "hf2", "--model", "llama"],
                                terminal_width=1000)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "does not fit the model llama (--model)" in lines[0]
    assert lines[0].endswith("pass --model the model the run trained")
    assert not (tmp_path / "hf2").exists()


def test_a_hub_id_or_a_preset_as_the_runs_model_path_still_exports(trained, tmp_path,
                                                                  monkeypatch):
    import shutil

    run = _copy_run(trained, tmp_path)
    monkeypatch.chdir(tmp_path)
    repo = tmp_path / "hub" / "models--org--trained"
    shutil.copytree(trained["model"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _recorded(run, "org/trained")
    export_model(run, tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(weights[n], t) for n, t in trained["saved"][2].items())
    # A preset: the run trained its random init (same shapes as the tied tiny model).
    monkeypatch.setenv("HANDOFF_CACHE", str(tmp_path / "cache"))
    _recorded(run, "tiny-qwen3")
    export_model(run, tmp_path / "hf-preset")
    assert json.loads((tmp_path / "hf-preset" / "handoff_export.json").read_text())["model"] \
        == str(tmp_path / "cache" / "tiny-qwen3")


# ---------------------------------------------------------------- an --out it cannot write


def test_an_out_under_a_file_is_one_line_before_anything_is_read(trained, tmp_path):
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(HandoffError) as e:
        export_model(trained["run"], tmp_path / "a-file" / "sub" / "hf")
    said = str(e.value)
    assert f"{tmp_path / 'a-file'} is a file, not a directory: pass an --out under a " \
           "directory" in said
    assert (tmp_path / "a-file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_read_only_out_is_one_line_and_nothing_is_written(trained, tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for out in (locked / "hf", locked):
            with pytest.raises(HandoffError, match=f"{locked} is not writable .*: pass a "
                                                   "directory you can write to"):
                export_model(trained["run"], out)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def _failing_save(error, written):
    """safetensors' save_file that writes part of the file, then fails with `error`."""
    def save_file(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        written.append(path)
        raise error
    return save_file


@pytest.mark.parametrize("kind", ["OSError", "SafetensorError"])
def test_a_full_disk_is_one_line_and_the_export_leaves_nothing(trained, tmp_path, monkeypatch,
                                                               kind):
    import errno
    import os

    import safetensors.torch
    from safetensors import SafetensorError
    from typer.testing import CliRunner

    from handoff.cli import app

    error = (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if kind == "OSError" else
             SafetensorError("Error while serializing: I/O error: No space left on device "
                             "(os error 28) at path \"x\""))
    written = []
    monkeypatch.setattr(safetensors.torch, "save_file", _failing_save(error, written))
    out = tmp_path / "new" / "hf"
    result = CliRunner().invoke(app, ["export", str(trained["run"]), "--out", str(out)],
                                terminal_width=1000)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "the disk is full (No space left on device" in lines[0]
    assert "the export needs about" in lines[0] and "another disk" in lines[0]
    assert written and not (tmp_path / "new").exists()   # its directories went too

    # Into a used directory with --overwrite: the user's files stay, no staging left.
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(HandoffError, match="the disk is full"):
        export_model(trained["run"], used, overwrite=True)
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
    # Another failed write (a permission the up-front check could not see): one line too.
    monkeypatch.setattr(safetensors.torch, "save_file",
                        _failing_save(PermissionError(errno.EACCES, "Permission denied"),
                                      written))
    with pytest.raises(HandoffError, match=r"cannot be written \(Permission denied\): pass a "
                                           "directory you can write to"):
        export_model(trained["run"], used, overwrite=True)
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
