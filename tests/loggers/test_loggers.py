"""run.loggers: TensorBoard events as before, a wandb run written offline and an MLflow run in
a file store, each read back with its own tools; samples.jsonl; a missing package's one line."""

import glob
import json
import os
import subprocess
import sys

import pytest

from handoff.config import load_config, to_dict
from handoff.errors import HandoffError
from handoff.loggers import check_loggers, open_loggers

ROWS = [{"step": 1, "reward_mean": 0.25, "actor/lr": 1e-3, "switch/raw_s": 0.5, "note": "x"},
        {"step": 2, "reward_mean": 0.75, "actor/lr": 5e-4, "switch/raw_s": 0.25, "note": "y"}]
SAMPLES = [("1+1=", "2", 1.0), ("1+1=", "3", 0.0), ("2+2=", "4", 1.0)]


def _cfg(out_dir, *extra):
    return load_config(None, [f"run.out_dir={out_dir}", "actor.lr=0.001", *extra])


def _run(cfg, out_dir, first_step=0, rows=ROWS):
    loggers = open_loggers(cfg, out_dir, first_step=first_step)
    loggers.log_config(to_dict(cfg))
    for row in rows:
        loggers.log_metrics(row, row["step"])
        loggers.log_samples(row["step"], SAMPLES)
    loggers.close()


def test_tensorboard_gets_every_numeric_key_and_the_samples_as_text(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    _run(_cfg(tmp_path, "run.log_samples=2"), tmp_path)
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    # as before the room: every number of the row but the step, under its own key
    assert sorted(events.Tags()["scalars"]) == ["actor/lr", "reward_mean", "switch/raw_s"]
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    texts = events.Tensors("samples/text_summary")
    assert [e.step for e in texts] == [1, 2]
    shown = texts[0].tensor_proto.string_val[0].decode()
    assert "reward 1.000" in shown and "reward 0.000" in shown and "2+2=" not in shown
    assert "actor" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_samples_jsonl_keeps_a_few_per_step_and_a_resume_drops_the_repeated_ones(tmp_path):
    cfg = _cfg(tmp_path, "run.loggers=[]", "run.log_samples=2")
    _run(cfg, tmp_path)
    path = tmp_path / "samples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": s, "prompt": "1+1=", "completion": c, "reward": r}
                    for s in (1, 2) for c, r in (("2", 1.0), ("3", 0.0))]
    with path.open("a") as f:
        f.write('{"step": 3, "prompt": "cut sh')   # a crash mid-write
    _run(cfg, tmp_path, first_step=1, rows=ROWS[1:])  # the resume repeats step 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 2, 2]
    _run(_cfg(tmp_path, "run.loggers=[]", "run.log_samples=0"), tmp_path, first_step=2, rows=[])
    assert len(path.read_text().splitlines()) == 4


def test_wandb_offline_writes_a_run_with_the_metrics_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _run(_cfg(tmp_path, "run.loggers=[wandb]", "run.wandb_project=demo"), tmp_path)
    (log,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    out = subprocess.run(["wandb", "leet", "inspect", "--json", log], capture_output=True,
                         text=True, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "demo" and run["display_name"] == tmp_path.name
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h["reward_mean"], h["actor/lr"]) for h in history] == [
        (1, 0.25, 1e-3), (2, 0.75, 5e-4)]
    assert "reward 1.000" in history[0]["samples"]
    configs = [r["config"] for r in records if r["type"] == "config"]
    assert any(c["update"].get("actor", {}).get("lr") == 1e-3 for c in configs)


@pytest.mark.parametrize("where", ["out_dir", "MLFLOW_TRACKING_URI"])
def test_mlflow_writes_a_run_with_metrics_and_params(tmp_path, monkeypatch, where):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if not k.startswith("MLFLOW_")})
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    store = out_dir / "mlruns"
    if where == "MLFLOW_TRACKING_URI":
        store = tmp_path / "elsewhere"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _run(_cfg(out_dir, "run.loggers=[mlflow]"), out_dir)
    assert store.is_dir() and (where == "out_dir") == (out_dir / "mlruns").is_dir()
    client = MlflowClient(tracking_uri=store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("handoff").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["actor.lr"] == "0.001" and run.data.params["run.loggers"] == "['mlflow']"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert "note" not in run.data.metrics
    text = client.download_artifacts(run.info.run_id, "samples/step_000002.md", str(tmp_path))
    assert "reward 1.000" in open(text).read()


def test_a_missing_logger_package_names_the_pip_command(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(HandoffError, match=r"run.loggers names wandb but wandb is not installed: "
                                           r"pip install 'handoff\[wandb\]'"):
        check_loggers(["tensorboard", "wandb"])
    with pytest.raises(HandoffError, match=r"handoff\[wandb\]"):
        open_loggers(_cfg(tmp_path, "run.loggers=[wandb]"), tmp_path, first_step=0)
    assert not (tmp_path / "wandb").exists()
    check_loggers(["tensorboard", "mlflow"])


@pytest.mark.parametrize("preset, expected", [(None, "true"), ("false", "false")])
def test_mlflows_telemetry_is_off_unless_the_user_set_it(preset, expected):
    # it writes ~/.config/mlflow/: off from the loggers' import, before a run imports mlflow
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_DISABLE_TELEMETRY"}
    if preset is not None:
        env["MLFLOW_DISABLE_TELEMETRY"] = preset
    out = subprocess.run([sys.executable, "-c", "import os, handoff.loggers; "
                          "print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == expected

