"""`handoff bench sweep` on CPU: points in their own processes, planned beside measured, an
out-of-memory point as the boundary, files written and added to."""

import json

import pytest
from typer.testing import CliRunner

from handoff.bench.sweep import failed_point
from handoff.cli import app
from handoff.errors import HandoffError
from handoff.modelzoo import init_model

KEYS = ("kv_pool_bytes", "generation_seconds", "tokens_per_second", "decode_step_seconds")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("sweep-model"), dtype="float32")


def _sweep(out, model_dir, *args):
    result = CliRunner().invoke(app, ["bench", "sweep", "examples/cpu-tiny.yaml",
                                      f"model.path={model_dir}",
                                      "rollout.response_lengths=uniform:min=2,max=8",
                                      *args, "--steps", "2", "--out", str(out)],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    return json.loads((out / "sweep.json").read_text())


def test_two_points_an_exclusive_card_and_a_boundary(model_dir, tmp_path):
    state = _sweep(tmp_path, model_dir, "--utils", "0.5,0.6")
    assert sorted(state["points"]) == ["all@0.50", "all@0.60"]
    for point in [*state["points"].values(), state["exclusive"]]:
        assert point["measured"]["status"] == "ok"
        for key in KEYS:
            assert point["measured"][key] > 0 and point["planned"][key] > 0
        assert point["measured"]["peak_running"] >= 1
    first, second = (state["points"][k]["measured"] for k in ("all@0.50", "all@0.60"))
    assert "d2h_bps" in first["rates"] and second["rates"] == first["rates"]  # measured once
    assert set(first["probes_driver_used"]) == {"before resume weights", "after update_weights",
                                                "after resume kv_cache"}
    # A pool too small for one sequence is the boundary; the points above it are not run,
    # the earlier points stay, and the files are written again.
    state = _sweep(tmp_path, model_dir, "rollout.num_blocks=3", "--utils", "0.7,0.8",
                   "--no-exclusive")
    assert sorted(state["points"]) == ["all@0.50", "all@0.60", "all@0.70"]
    assert state["boundary"]["all"]["util"] == 0.7
    assert state["boundary"]["all"]["owner"] == "engine KV pool (sizing at start)"
    text = (tmp_path / "sweep.md").read_text()
    assert "all@0.60" in text and "Boundary of `all`: utilization 0.70" in text
    assert "exclusive card" in text and (tmp_path / "sweep.png").stat().st_size > 10_000
    # --replan runs nothing and plans every point again from the rates it measured.
    planned = {k: p.get("planned") for k, p in state["points"].items()}
    for p in state["points"].values():
        p.pop("planned", None)
    (tmp_path / "sweep.json").write_text(json.dumps(state))
    result = CliRunner().invoke(app, ["bench", "sweep", "examples/cpu-tiny.yaml",
                                      f"model.path={model_dir}",
                                      "rollout.response_lengths=uniform:min=2,max=8",
                                      "--out", str(tmp_path), "--replan"], terminal_width=200)
    assert result.exit_code == 0, result.output
    again = json.loads((tmp_path / "sweep.json").read_text())
    assert sorted(again["points"]) == sorted(planned)
    for label, p in again["points"].items():
        assert p.get("planned") == planned[label], label


def test_a_failure_says_out_of_memory_and_who_did_not_fit(tmp_path):
    log = ("step 1 ...\nerror: cannot wake ['kv_cache']: needs 100.00 GiB + margin 256.0 MiB "
           "but the driver has 40.00 GiB free; at probe 'after params offload': ...")
    got = failed_point(log, tmp_path)
    assert got["status"] == "out_of_memory" and got["owner"] == "engine KV pool (wake)"
    assert got["message"].startswith("error: cannot wake")
    torch_oom = failed_point("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.",
                             tmp_path)
    assert torch_oom["owner"].startswith("trainer")
    other = failed_point("error: model.path='x' is not an HF checkpoint directory", tmp_path)
    assert other["status"] == "error" and other["owner"] is None


def test_a_link_or_a_file_where_the_sweep_writes_is_one_line_and_nothing_is_written(
        model_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("VICTIM")
    out = tmp_path / "sweep"
    (out / "points").mkdir(parents=True)
    for name, link in (("sweep.md", out / "sweep.md"),
                       ("a point", out / "points" / "all@0.50")):
        link.symlink_to(victim)
        result = CliRunner().invoke(app, ["bench", "sweep", "examples/cpu-tiny.yaml",
                                          f"model.path={model_dir}", "--utils", "0.5",
                                          "--steps", "2", "--out", str(out)], terminal_width=300)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, (name, result.output)
        assert "is a symbolic link" in lines[0], name
        assert victim.read_text() == "VICTIM" and not (out / "sweep.json").exists()
        link.unlink()
    result = CliRunner().invoke(app, ["bench", "sweep", "examples/cpu-tiny.yaml",
                                      f"model.path={model_dir}", "--out", str(victim)],
                                terminal_width=300)
    assert result.exit_code == 2 and "is a file, not a directory" in result.output


def test_a_bad_model_is_one_line_before_any_point_runs(tmp_path, monkeypatch):
    import handoff.bench.sweep as sweep

    def no_point(*args, **kwargs):
        raise AssertionError("a point ran")

    monkeypatch.setattr(sweep.subprocess, "Popen", no_point)
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "notes.txt").write_text("mine")
    for path, said in ((tmp_path / "nowhere", "is not an HF checkpoint directory"),
                       (tmp_path / "not-a-model", "is not an HF checkpoint directory"),
                       (tmp_path / "not-a-model" / "notes.txt",
                        "is not an HF checkpoint directory")):
        out = tmp_path / "sweep"
        result = CliRunner().invoke(app, ["bench", "sweep", "examples/cpu-tiny.yaml",
                                          f"model.path={path}", "--utils", "0.5",
                                          "--no-exclusive", "--steps", "2", "--out", str(out)],
                                    terminal_width=300)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert lines[0].startswith(f"error: model.path='{path}' {said}"), lines[0]
        assert not out.exists()   # nothing written
    # the Python API refuses it too
    with pytest.raises(HandoffError, match="is not an HF checkpoint directory"):
        sweep.run_sweep("examples/cpu-tiny.yaml", [f"model.path={tmp_path / 'nowhere'}"],
                        out_dir=str(tmp_path / "api"), utils=[0.5], offloads=None,
                        exclusive=False)
    assert not (tmp_path / "api").exists()
