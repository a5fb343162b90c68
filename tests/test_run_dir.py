"""A run's out_dir: a used one is refused unless asked (every byte kept), --overwrite removes
only a run's files, one live run per out_dir, a crash's cut-short metrics line, Ctrl-C."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from handoff.cli import app
from handoff.config import load_config, to_dict
from handoff.errors import HandoffError
from handoff.modelzoo import init_model
from handoff.run_dir import (check_out_dir, claim_out_dir, clear_earlier_run, earlier_run,
                             interrupted_message, keep_changed_config, read_metrics,
                             resume_command, trim_metrics)
from wrapped_text import flat

runner = CliRunner()



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("run-dir-model"), dtype="float32")


def _cfg(out_dir, *extra, model="tiny-qwen3"):
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                   f"run.out_dir={out_dir}", *extra])


def _earlier_run(out: Path) -> None:
    """What a finished run leaves (the content does not matter, only that it survives)."""
    (out / "checkpoints" / "step_00000002_abc").mkdir(parents=True)
    (out / "checkpoints" / "step_00000002_abc" / "meta.json").write_text('{"step": 2}')
    (out / "checkpoints" / "latest").write_text("step_00000002_abc")
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "config.json").write_text(json.dumps(to_dict(_cfg(out))))
    (out / "summary.json").write_text("{}")
    (out / "notes.txt").write_text("the user's own file")


def _snapshot(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_used_out_dir_is_refused_without_resume_or_overwrite_and_keeps_every_byte(
        model_dir, tmp_path):
    _earlier_run(tmp_path)
    before = _snapshot(tmp_path)
    res = runner.invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}",
                              f"run.out_dir={tmp_path}"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "holds an earlier run (config.json, metrics.jsonl, summary.json, checkpoints)" in \
        lines[0] and "--resume" in lines[0] and "--overwrite" in lines[0]
    assert _snapshot(tmp_path) == before


def test_overwrite_removes_the_run_files_and_nothing_else(tmp_path, capsys):
    _earlier_run(tmp_path)
    cfg = _cfg(tmp_path, "run.overwrite=true")
    lock = claim_out_dir(cfg)
    try:   # the claim removes nothing: the start's later checks may still refuse it
        assert "checkpoints" in {p.name for p in tmp_path.iterdir()}
        clear_earlier_run(cfg)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".handoff.lock", "notes.txt"]
        assert "overwrite: removed the earlier run's" in capsys.readouterr().err
    finally:
        lock.release()


def _foreign(out: Path, model_dir: Path) -> None:
    """Files with a run's names that no handoff run wrote: a model's config.json, another
    tool's checkpoints/ and wandb/."""
    out.mkdir(exist_ok=True)
    (out / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    (out / "checkpoints" / "other").mkdir(parents=True)
    (out / "checkpoints" / "other" / "model.pt").write_bytes(b"weights")
    (out / "wandb" / "run-1").mkdir(parents=True)


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
def test_files_that_are_not_a_handoff_run_are_never_removed_or_written_over(
        model_dir, tmp_path, flag):
    _foreign(tmp_path / "proj", model_dir)
    before = _snapshot(tmp_path / "proj")
    res = runner.invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}",
                              f"run.out_dir={tmp_path / 'proj'}", flag], terminal_width=400)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "not a handoff run's" in lines[0] and "choose another run.out_dir" in lines[0]
    assert _snapshot(tmp_path / "proj") == before


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
def test_the_models_own_directory_is_refused_as_out_dir(model_dir, tmp_path, flag):
    model = tmp_path / "m"
    model.mkdir()
    for f in model_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    before = _snapshot(model)
    res = runner.invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model}",
                              f"run.out_dir={model}", flag], terminal_width=400)
    assert res.exit_code == 2 and "is the model's directory" in res.output, res.output
    assert _snapshot(model) == before


def test_overwrite_keeps_the_earlier_run_when_a_later_check_refuses_the_start(
        model_dir, tmp_path):
    """The reward function is loaded after the out_dir is claimed: its refusal must find the
    earlier run whole."""
    _earlier_run(tmp_path)
    before = _snapshot(tmp_path)
    res = runner.invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}",
                              f"run.out_dir={tmp_path}", "reward.functions=[nosuchmod:f]",
                              "--overwrite"], terminal_width=400)
    assert res.exit_code == 2 and "nosuchmod" in res.output, res.output
    assert "removed" not in res.output
    assert {k: v for k, v in _snapshot(tmp_path).items() if k != ".handoff.lock"} == before


def test_a_run_that_failed_in_its_first_step_is_replaced_by_the_corrected_command(
        model_dir, tmp_path):
    """An error met in the first step (a prompt longer than max_model_len) leaves the start's
    files and the memory timeline; nothing trained, so the command run again once fixed
    replaces them without --overwrite, and a file of the user's stays."""
    out = tmp_path / "run"
    command = ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}",
               f"run.out_dir={out}", "run.steps=1", "run.checkpoint=false"]
    failed = runner.invoke(app, [*command, "rollout.max_model_len=9"], terminal_width=400)
    assert failed.exit_code == 2 and "max_model_len" in failed.output, failed.output
    left = set(earlier_run(out))
    assert "config.json" in left and "metrics.jsonl" not in left
    (out / "notes.txt").write_text("the user's own file")
    again = runner.invoke(app, command, terminal_width=400)
    assert again.exit_code == 0, again.output
    assert flat("an earlier start that finished no step: removed") in flat(again.output)
    assert (out / "metrics.jsonl").is_file() and (out / "notes.txt").is_file()
    # A run that finished a step is no longer replaced unasked.
    refused = runner.invoke(app, command, terminal_width=400)
    assert refused.exit_code == 2 and "holds an earlier run" in refused.output


def test_a_refused_start_leaves_no_out_dir_it_made(model_dir, tmp_path):
    out = tmp_path / "new" / "run"
    res = runner.invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}",
                              f"run.out_dir={out}", "reward.functions=[nosuchmod:f]"],
                        terminal_width=400)
    assert res.exit_code == 2 and not out.exists(), res.output


def test_a_logger_that_cannot_start_leaves_no_out_dir_it_made(model_dir, tmp_path,
                                                             monkeypatch):
    import handoff.run_report as run_report
    from handoff.errors import HandoffError

    def refuse(cfg, out_dir, *, first_step):   # as wandb does without a login, after its dir
        (out_dir / "wandb").mkdir()
        raise HandoffError("wandb could not start a run (no API key): run `wandb login`")

    monkeypatch.setattr(run_report, "open_loggers", refuse)
    out = tmp_path / "new" / "run"
    args = ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}", f"run.out_dir={out}",
            "run.steps=1"]
    res = runner.invoke(app, args, terminal_width=400)
    assert res.exit_code == 2 and "wandb could not start" in res.output
    assert not out.exists(), sorted(p.name for p in out.iterdir())   # the next start is free


def test_a_resume_with_changed_settings_names_them_and_keeps_the_earlier_config(
        tmp_path, capsys):
    before = _cfg(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(to_dict(before)))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    keep_changed_config(_cfg(tmp_path, "run.resume=true", "run.steps=9"), 2)   # a longer run: no
    # word (the flag and run.steps change on every resume that extends a run)
    assert not list(tmp_path.glob("config.before-*")) and not capsys.readouterr().err
    keep_changed_config(_cfg(tmp_path, "run.resume=true", "actor.lr=0.5", "rollout.n=2"), 2)
    err = flat(capsys.readouterr().err)
    assert flat("settings changed since the run began") in err
    assert "actor.lr" in err and "rollout.n" in err and "config.before-step-2.json" in err
    kept = json.loads((tmp_path / "config.before-step-2.json").read_text())
    assert kept == to_dict(before)
    assert "config.before-step-2.json" in earlier_run(tmp_path)   # --overwrite removes it too


def test_a_second_resume_from_the_same_step_compares_with_the_config_that_trained_it(
        tmp_path, capsys):
    """A resume from step 2 that failed before checkpointing again left config.json with its
    own settings, which trained nothing kept: the next resume from step 2 names the change
    against the config that trained steps 1-2 and keeps that record (it was replaced by the
    failed resume's settings before; a tester's find)."""
    began = _cfg(tmp_path, "actor.lr=0.001")
    (tmp_path / "config.json").write_text(json.dumps(to_dict(began)))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    keep_changed_config(_cfg(tmp_path, "run.resume=true", "actor.lr=0.005"), 2)
    (tmp_path / "config.json").write_text(json.dumps(to_dict(_cfg(tmp_path, "actor.lr=0.005"))))
    capsys.readouterr()
    keep_changed_config(_cfg(tmp_path, "run.resume=true", "actor.lr=0.002"), 2)
    err = flat(capsys.readouterr().err)
    assert flat("actor.lr 0.001 -> 0.002") in err
    kept = json.loads((tmp_path / "config.before-step-2.json").read_text())
    assert kept["actor"]["lr"] == 0.001
    keep_changed_config(_cfg(tmp_path, "run.resume=true", "actor.lr=0.001"), 2)   # set back
    assert not capsys.readouterr().err


def test_a_second_live_run_on_one_out_dir_is_refused(tmp_path):
    first = claim_out_dir(_cfg(tmp_path))
    with pytest.raises(HandoffError, match=rf"is in use by a live run \(pid {os.getpid()}\)"):
        claim_out_dir(_cfg(tmp_path, "run.resume=true"))
    first.release()
    claim_out_dir(_cfg(tmp_path, "run.resume=true")).release()   # free once the run ended


CLAIM_AND_WAIT = """
import sys, time
from handoff.config import load_config
from handoff.run_dir import claim_out_dir
lock = claim_out_dir(load_config(None, ["run.out_dir=" + sys.argv[1]]))
print("CLAIMED", flush=True)
time.sleep(600)
"""


def test_the_lock_of_a_killed_run_is_free_and_a_live_ones_refuses_train(model_dir, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CLAIM_AND_WAIT, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "CLAIMED"
        res = runner.invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}",
                                  f"run.out_dir={tmp_path}", "--resume"])
        assert res.exit_code == 2, res.output
        assert f"is in use by a live run (pid {proc.pid})" in res.output
    finally:
        proc.send_signal(signal.SIGKILL)   # no cleanup runs: the kernel drops the lock
        proc.wait()
    claim_out_dir(_cfg(tmp_path, "run.resume=true")).release()


def test_an_out_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "run"):
        with pytest.raises(HandoffError, match=r"f is a file, not a directory"):
            check_out_dir(_cfg(out))


def _metrics(path: Path, steps: int, tail: bytes) -> None:
    rows = "".join(json.dumps({"step": s, "reward_mean": 0.1 * s, "response_length": 3.0,
                               "timing_s/gen": 0.1, "timing_s/step": 0.5}) + "\n"
                   for s in range(1, steps + 1))
    path.write_bytes(rows.encode() + tail)


def test_a_truncated_metrics_line_is_named_and_the_rows_before_it_are_reported(tmp_path):
    _metrics(tmp_path / "metrics.jsonl", 3, b'{"step": 4, "reward_me')
    res = runner.invoke(app, ["report", str(tmp_path)], terminal_width=200)
    assert res.exit_code == 0, res.output
    said = flat(res.output)   # a long tmp path wraps the line
    assert flat("metrics.jsonl line 4 is not a complete metrics row") in said
    assert flat("using the 3 row(s) before it") in said and "3steps" in said
    assert "│    3 │  0.300" in res.output and "│    4 │" not in res.output


def test_a_resume_keeps_the_rows_before_a_bad_line_and_never_unpickles_it(tmp_path, capsys):
    import pickle

    class Plant:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    _metrics(tmp_path / "metrics.jsonl", 3, pickle.dumps(Plant()) + b"\n")
    trim_metrics(tmp_path, start_step=2)
    rows, problem = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and problem is None
    err = capsys.readouterr().err
    assert "line 4 is not a complete metrics row" in err and "dropping 1 metrics row(s)" in err
    assert not (tmp_path / "ran").exists()


def test_a_failed_resume_leaves_the_runs_config_as_it_was(model_dir, tmp_path):
    from handoff.loop import train

    _earlier_run(tmp_path)
    (tmp_path / "checkpoints" / "step_00000002_abc" / "meta.json").write_text('{"step": 2, "fo')
    before = (tmp_path / "config.json").read_bytes()
    with pytest.raises(HandoffError, match="meta.json is not valid JSON"):
        train(_cfg(tmp_path, "run.resume=true", "run.steps=3", model=model_dir))
    assert (tmp_path / "config.json").read_bytes() == before


def test_ctrl_c_says_where_the_run_can_resume_from(model_dir, tmp_path, monkeypatch):
    import handoff.api

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(handoff.api, "train", interrupted)   # what the CLI calls
    args = ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}",
            f"run.out_dir={tmp_path}"]
    res = runner.invoke(app, [*args, "--overwrite"], terminal_width=300)
    assert res.exit_code == 130
    assert ("interrupted before the first checkpoint: `handoff train examples/cpu-tiny.yaml "
            f"model.path={model_dir} run.out_dir={tmp_path} --resume` starts again at "
            "step 0") in res.output
    _earlier_run(tmp_path)
    text = interrupted_message(_cfg(tmp_path), "handoff train C")
    assert text == ("interrupted: the run can resume from step 2 "
                    f"({tmp_path / 'checkpoints' / 'step_00000002_abc'}) with "
                    "`handoff train C --resume`")
    assert "nothing to resume" in interrupted_message(_cfg(tmp_path, "run.checkpoint=false"), "c")


def test_the_resume_command_is_the_command_as_given_with_its_overrides():
    assert resume_command("c.yaml", ["run.steps=9", "data.path=my data/[x].jsonl",
                                     "run.overwrite=true", "run.resume = false"]) == \
        "handoff train c.yaml run.steps=9 'data.path=my data/[x].jsonl'"


def test_ctrl_c_inside_a_checkpoint_save_is_the_one_line_and_exit_130(model_dir, tmp_path,
                                                                     monkeypatch):
    """DCP wraps the KeyboardInterrupt in a CheckpointException: still the one line."""
    import torch.distributed.checkpoint as dcp

    saves = []
    write_data = dcp.FileSystemWriter.write_data

    def interrupted_second_save(self, *args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", interrupted_second_save)
    out = tmp_path / "my run [1]"
    args = ["train", "examples/cpu-tiny.yaml", f"model.path={model_dir}", f"run.out_dir={out}",
            "run.steps=3", "run.save_every=1"]
    res = runner.invoke(app, args, terminal_width=400)
    assert res.exit_code == 130, res.output
    assert "Traceback" not in res.output and "CheckpointException" not in res.output
    said = [line for line in res.output.splitlines() if "interrupted" in line]
    step_1 = next((out / "checkpoints").glob("step_00000001_*"))
    assert said == [f"interrupted: the run can resume from step 1 ({step_1}) with `handoff "
                    f"train examples/cpu-tiny.yaml model.path={model_dir} 'run.out_dir={out}' "
                    "run.steps=3 run.save_every=1 --resume`"]
    assert not list((out / "checkpoints").glob(".tmp_*"))


# ---------------------------------------------------------------- a resume's checkpoint, read


@pytest.fixture(scope="module")
def checkpointed(model_dir, tmp_path_factory):
    """A real two-step run with a checkpoint after each step; tests copy it."""
    from handoff.loop import train

    out = tmp_path_factory.mktemp("checkpointed") / "run"
    train(_cfg(out, "run.save_every=1", model=model_dir))
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".handoff.lock"))
    return dst


def test_a_resume_with_latest_gone_continues_from_the_newest_complete_checkpoint(
        model_dir, checkpointed, tmp_path, capsys):
    """It used to start over at step 0, drop every metrics row and prune the checkpoints."""
    from handoff.loop import train

    out = _copy_run(checkpointed, tmp_path / "run")
    (out / "checkpoints" / "latest").unlink()
    step_2 = next((out / "checkpoints").glob("step_00000002_*"))
    said = interrupted_message(_cfg(out), "handoff train C")
    assert said == f"interrupted: the run can resume from step 2 ({step_2}) with `handoff train C --resume`"
    capsys.readouterr()
    train(_cfg(out, "run.resume=true", "run.steps=3", "run.save_every=1", model=model_dir))
    said = capsys.readouterr()
    err = flat(said.out + said.err)
    assert flat(f"resume: {out / 'checkpoints' / 'latest'} is missing: continuing from the newest "
                f"complete checkpoint, {step_2.name}") in err
    assert "dropping" not in err and "starting at step 0" not in err
    rows, _ = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (out / "checkpoints" / "latest").read_text().startswith("step_00000003_")
    assert step_2.is_dir()   # kept: the newest two


def test_a_checkpoint_whose_step_was_never_logged_is_no_stand_in_for_latest(
        model_dir, checkpointed, tmp_path):
    """Killed between a checkpoint's save and its metrics row (Run._save: unpublished), the
    run has no `latest` naming it: a resume must not skip that step's row."""
    from handoff.preflight import _start_step
    from handoff.run_dir import resume_point

    out = _copy_run(checkpointed, tmp_path / "run")
    (out / "checkpoints" / "latest").unlink()
    rows, _ = read_metrics(out / "metrics.jsonl")
    (out / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")   # step 2's row never written
    step_1 = next((out / "checkpoints").glob("step_00000001_*"))
    assert resume_point(out) == (step_1, True)
    assert _start_step(out) == 1
    assert "resume from step 1" in interrupted_message(_cfg(out), "c")
    (out / "metrics.jsonl").unlink()   # no step logged: nothing published, a start from 0
    assert resume_point(out) == (None, False) and _start_step(out) == 0


def test_preflight_reads_the_stand_in_and_refuses_a_hand_edit_before_the_card(
        model_dir, checkpointed, tmp_path):
    from handoff.preflight import preflight

    out = _copy_run(checkpointed, tmp_path / "run")
    (out / "checkpoints" / "latest").unlink()
    with pytest.raises(HandoffError, match=r"is at step 2, run.steps=1: raise run.steps"):
        preflight(_cfg(out, "run.resume=true", "run.steps=1", model=model_dir))
    step_2 = next((out / "checkpoints").glob("step_00000002_*"))
    meta = json.loads((step_2 / "meta.json").read_text())
    (step_2 / "meta.json").write_text(json.dumps({**meta, "world_size": 0}))
    with pytest.raises(HandoffError, match=r"no valid world_size \(0"):
        preflight(_cfg(out, "run.resume=true", "run.steps=3", model=model_dir))


@pytest.mark.parametrize("edit, named", [
    (lambda meta: meta.update(step=5), "records step 5 but its directory was saved at step 2"),
    (lambda meta: meta.update(world_size="1"), "no valid world_size ('1'"),
    (lambda meta: meta.update(optimizer_step=-3), "no valid optimizer_step (-3"),
    (lambda meta: meta["extra"]["task"].update(position="8"), "no valid data position"),
])
def test_a_hand_edited_meta_json_is_one_line_and_the_run_is_left_as_it_was(
        model_dir, checkpointed, tmp_path, edit, named):
    from handoff.loop import train

    out = _copy_run(checkpointed, tmp_path / "run")
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((latest / "meta.json").read_text())
    edit(meta)
    (latest / "meta.json").write_text(json.dumps(meta))
    before = _snapshot(out)
    with pytest.raises(HandoffError, match=re.escape(named)) as e:
        train(_cfg(out, "run.resume=true", "run.steps=3", "actor.lr=0.5", model=model_dir))
    assert "\n" not in str(e.value) and "edited by hand" in str(e.value)
    after = _snapshot(out)
    after.pop(".handoff.lock")   # the refused start's lock (nobody holds it now)
    assert after == before   # config.json, metrics and checkpoints as they were


@pytest.mark.parametrize("before, resumed, step, said", [
    # step 3 of 4 under cosine: lr (1 + cos(pi 2/4)) / 2 = 0.5 lr; of 8: (1 + cos(pi 2/8)) / 2
    (["run.steps=4"], ["run.steps=8"], 2, "step 3 trains at lr 0.000854 (as begun: 0.0005)"),
    # the earlier curve is the earlier config's (its own lr), not today's
    (["run.steps=4"], ["run.steps=8", "actor.lr=0.5"], 2,
     "step 3 trains at lr 0.427 (as begun: 0.0005)"),
    # past the earlier run's end: the rate its last step had (cosine's last step: above 0)
    (["run.steps=4"], ["run.steps=8"], 4,
     "step 5 trains at lr 0.0005 (the run as begun ended at step 4, at lr 0.000146)"),
    # a warm-up as long as the run: no decay steps (it divided by zero)
    (["run.steps=4", "actor.warmup_steps=4"], ["run.steps=8", "actor.warmup_steps=4"], 4,
     "step 5 trains at lr 0.001 (the run as begun ended at step 4, at lr 0.001)"),
])
def test_a_longer_run_under_a_decaying_lr_schedule_is_named_with_the_lr_it_changes(
        tmp_path, capsys, before, resumed, step, said):
    old = _cfg(tmp_path, "actor.lr_schedule=cosine", *before)
    assert old.actor.lr == 1e-3
    (tmp_path / "config.json").write_text(json.dumps(to_dict(old)))
    keep_changed_config(_cfg(tmp_path, "run.resume=true", "actor.lr_schedule=cosine", *resumed),
                        step)
    err = flat(capsys.readouterr().err)
    assert flat("settings changed since the run began: ") in err and flat("run.steps 4 -> 8") in err
    assert flat(said) in err
    assert (tmp_path / f"config.before-step-{step}.json").is_file()


def test_an_older_runs_relative_model_path_is_no_changed_setting(model_dir, tmp_path,
                                                                  monkeypatch, capsys):
    old = to_dict(_cfg(tmp_path / "run", model=model_dir.name))
    assert old["model"]["path"] == model_dir.name   # relative, as older runs recorded it
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(old))
    resumed = _cfg(tmp_path / "run", "run.resume=true", model=model_dir.name)
    monkeypatch.chdir(model_dir.parent)
    keep_changed_config(resumed, 2)
    assert not capsys.readouterr().err


def test_the_run_records_a_local_model_directory_absolute_and_a_moved_run_is_no_change(
        model_dir, tmp_path, monkeypatch, capsys):
    from handoff.run_dir import run_record, write_run_config

    cfg = _cfg(tmp_path / "run", model=model_dir.name)   # relative, as a user types it
    preset = _cfg(tmp_path, model="tiny-qwen3")
    resumed = _cfg(tmp_path / "moved", "run.resume=true", model=model_dir.name)
    monkeypatch.chdir(model_dir.parent)
    assert run_record(cfg)["model"]["path"] == str(model_dir.resolve())
    assert run_record(preset)["model"]["path"] == "tiny-qwen3"
    (tmp_path / "run").mkdir()
    write_run_config(cfg)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["model"]["path"] == str(model_dir.resolve())
    moved = _copy_run(tmp_path / "run", tmp_path / "moved")   # a copied run directory
    keep_changed_config(resumed, 2)
    assert not capsys.readouterr().err and not list(moved.glob("config.before-*"))


def test_the_resume_command_under_torchrun_keeps_the_launcher():
    one_node = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert resume_command("c.yaml", ["parallel.gpus=2"], one_node) == \
        "torchrun --nproc-per-node 2 -m handoff train c.yaml parallel.gpus=2"
    two_nodes = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert resume_command("c.yaml", [], two_nodes).startswith(
        "torchrun --nnodes 2 --nproc-per-node 4 <this launch's rendezvous options> -m handoff")
    assert resume_command("c.yaml", [], {}) == "handoff train c.yaml"


def _run_script(script: Path, *, timeout: float) -> subprocess.CompletedProcess:
    """`script` as a process of its own from the repository root (a signal it sends itself
    is real), its output captured."""
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, timeout=timeout)


def test_sigterm_winds_up_as_ctrl_c_does_with_the_shells_status(tmp_path):
    """`timeout`, SLURM and `docker stop` send SIGTERM: the run says where it can resume
    from, as after Ctrl-C, and exits 143 (a process of its own: the signal is real)."""
    script = tmp_path / "term.py"
    script.write_text(f"""
import os, signal, sys, time
import handoff.api
from handoff.cli import app

def terminated(cfg):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)   # the signal arrives while the run works

handoff.api.train = terminated
sys.argv = ["handoff", "train", "examples/cpu-tiny.yaml", "run.out_dir={tmp_path / 'run'}"]
app()
""")
    res = _run_script(script, timeout=25)
    assert res.returncode == 143, res.stderr
    assert "Traceback" not in res.stderr
    assert flat("interrupted before the first checkpoint") in flat(res.stderr)


def test_a_second_ctrl_c_while_the_run_winds_up_is_no_traceback(tmp_path):
    """The second SIGINT arrives while the one line is being made (a process of its own:
    the signal is real)."""
    script = tmp_path / "twice.py"
    script.write_text(f"""
import os, signal, sys
import handoff.api, handoff.run_dir
from handoff.cli import app

def interrupted(cfg):
    raise KeyboardInterrupt

def message(cfg, command):
    os.kill(os.getpid(), signal.SIGINT)   # the user presses Ctrl-C again
    return "interrupted: stand-in"

handoff.api.train = interrupted
handoff.run_dir.interrupted_message = message
sys.argv = ["handoff", "train", "examples/cpu-tiny.yaml", "run.out_dir={tmp_path / 'run'}"]
app()
""")
    res = _run_script(script, timeout=120)
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr and "interrupted: stand-in" in res.stderr
    # Pressed once the line is out (an exit stuck in a join): it ends the process at once.
    script.write_text(script.read_text().replace(
        'return "interrupted: stand-in"', 'import atexit, time\n    atexit.register(lambda: '
        '(os.kill(os.getpid(), signal.SIGINT), time.sleep(60)))\n    return "interrupted: stand-in"'))
    res = _run_script(script, timeout=50)
    assert res.returncode == -signal.SIGINT, res.stderr
    assert "Traceback" not in res.stderr and "interrupted: stand-in" in res.stderr
