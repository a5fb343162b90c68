"""RunReport: the ledger priced at the run's measured rates, and TensorBoard events that agree
with metrics.jsonl after a resume or a fresh start."""

import pytest
from rich.console import Console

from handoff.calibrate import Rates
from handoff.config import load_config
from handoff.memory.meter import MemoryMeter, step_probes
from handoff.plan.shapes import load_shape
from handoff.run_report import RunReport, map_priced_at_last_wake, planned_actions, summary_table
from handoff.runplan import RunPlan


def _report(tmp_path):
    cfg = load_config("examples/cpu-tiny.yaml", ["model.path=tiny-qwen3",
                                                 f"run.out_dir={tmp_path}", "run.steps=3"])
    return RunReport(RunPlan.build(cfg), tmp_path, rates=Rates({}), meter=MemoryMeter("cpu"), kv_pool_bytes=0)


def _log(report, first_step, rewards):
    report.start(first_step)
    for step, reward in enumerate(rewards, start=first_step + 1):
        report.log_step({"step": step, "reward_mean": reward, "reward_std": 0.0,
                         "response_length": 1.0, "timing_s/gen": 0.0, "timing_s/step": 0.0})
    report._progress.stop()
    report._loggers.close()


def test_resumed_steps_replace_the_crashed_runs_events(tmp_path, monkeypatch):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tensorboard.summary.writer import event_file_writer

    # TensorBoard reads a directory's event files in name order: time (s), host, pid, then a
    # per-process counter. Two writers of one process in one second sort by that counter as
    # text, so "10" before "9" (a resume is a new process in a later second: no such tie).
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))

    _log(_report(tmp_path), 0, [0.1, 0.2, 0.3])   # steps 1-3; say step 1's checkpoint survived
    _log(_report(tmp_path), 1, [0.5, 0.6])        # the resume repeats steps 2 and 3
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    points = [(e.step, round(e.value, 3)) for e in events.Scalars("reward_mean")]
    assert points == [(1, 0.1), (2, 0.5), (3, 0.6)]


RATES = {"d2h_bps": 5e9, "h2d_bps": 5e9, "d2d_bps": 20e9, "map_bps": 40e9, "unmap_bps": 80e9,
         "tensor_host_s": 2e-5, "sync_copy_bps": 1000e9}


def _cfg(model, out_dir, *extra):
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                   f"run.out_dir={out_dir}", *extra])


def _planned(cfg, rates: Rates, pool: float) -> dict:
    plan = RunPlan.build(cfg)
    return planned_actions(plan, rates, rates.profile(plan.hardware), pool)


def test_planned_actions_move_with_the_measured_rates(tmp_path):
    cfg = _cfg("qwen3-4b", tmp_path)
    pool = 100e9
    base = _planned(cfg, Rates(RATES), pool)
    slower_map = _planned(cfg, Rates({**RATES, "map_bps": RATES["map_bps"] / 2}), pool)
    assert slower_map["kv_cache_wake"]["seconds"] == pytest.approx(
        2 * base["kv_cache_wake"]["seconds"])
    assert base["kv_cache_wake"]["seconds"] == pytest.approx(pool / RATES["map_bps"])
    # The sync maps the engine's weights too, so it moves by their bytes / the map rate.
    weights = base["engine_weights_sync"]["bytes"]
    assert slower_map["engine_weights_sync"]["seconds"] == pytest.approx(
        base["engine_weights_sync"]["seconds"] + weights / RATES["map_bps"])
    assert slower_map["engine_sleep"] == base["engine_sleep"]
    slower_unmap = _planned(cfg, Rates({**RATES, "unmap_bps": RATES["unmap_bps"] / 4}), pool)
    assert slower_unmap["engine_sleep"]["seconds"] == pytest.approx(
        4 * base["engine_sleep"]["seconds"])
    assert base["engine_sleep"]["seconds"] == pytest.approx((weights + pool) / RATES["unmap_bps"])
    # Host and copies overlap: the copies set the sync's time until the host is slower.
    tensors = load_shape("qwen3-4b").num_tensors
    copies = 4 * weights / RATES["sync_copy_bps"]   # one dtype: into the bucket and out
    assert tensors * RATES["tensor_host_s"] < copies
    slower_copies = _planned(cfg, Rates({**RATES, "sync_copy_bps": 500e9}), pool)
    assert slower_copies["engine_weights_sync"]["seconds"] == pytest.approx(
        base["engine_weights_sync"]["seconds"] + copies)
    slower_host = _planned(cfg, Rates({**RATES, "tensor_host_s": 5e-4}), pool)
    assert tensors * 5e-4 > copies
    assert slower_host["engine_weights_sync"]["seconds"] == pytest.approx(
        base["engine_weights_sync"]["seconds"] - copies + tensors * 5e-4)
    # Measured at the weights' own size, the sync's map uses that rate; the KV wake does not.
    own = _planned(cfg, Rates({**RATES, "weights_map_bps": RATES["map_bps"] * 10}), pool)
    assert own["engine_weights_sync"]["seconds"] == pytest.approx(
        base["engine_weights_sync"]["seconds"] - 0.9 * weights / RATES["map_bps"])
    assert own["kv_cache_wake"] == base["kv_cache_wake"]
    # A measured kernel H2D rate prices the copies that follow the engine's sleep by kernel:
    # the ref's, and in turn (memory.overlap=false) the params' too.
    kernel = _planned(cfg, Rates({**RATES, "h2d_kernel_bps": RATES["h2d_bps"] / 2}), pool)
    assert kernel["ref_h2d"]["seconds"] == pytest.approx(2 * base["ref_h2d"]["seconds"])
    assert kernel["params_h2d"] == base["params_h2d"]   # streamed: on the copy engines
    assert kernel["optimizer_h2d"] == base["optimizer_h2d"]
    in_turn = _cfg("qwen3-4b", tmp_path, "memory.overlap=false")
    assert _planned(in_turn, Rates({**RATES, "h2d_kernel_bps": RATES["h2d_bps"] / 2}), pool)["params_h2d"]["seconds"] == pytest.approx(
        2 * _planned(in_turn, Rates(RATES), pool)["params_h2d"]["seconds"])
    # The run's sync is in-process: no per-bucket IPC charge, whatever the profile says.
    ipc_heavy = _cfg("qwen3-4b", tmp_path, "hardware.sync_bucket_ms=1000")
    assert _planned(ipc_heavy, Rates(RATES), pool) == base


def test_the_plotted_step_starts_from_the_card_as_the_last_switch_left_it():
    timeline = [{"name": "start", "step": -1}, {"name": "after generate", "step": 0},
                {"name": "after resume kv_cache", "step": 0},
                {"name": "kv pool grown", "step": 1}, {"name": "after generate", "step": 1},
                {"name": "after resume kv_cache", "step": 1}]
    names = [p["name"] for p in step_probes(timeline, 1)]
    # The elastic pool's wake, then its growth during the step's generation.
    assert names == ["after resume kv_cache (step 1)", "kv pool grown", "after generate",
                     "after resume kv_cache"]
    assert timeline[2]["name"] == "after resume kv_cache"   # the timeline is not renamed
    assert [p["name"] for p in step_probes(timeline, 0)][0] == "start (step 0)"
    assert step_probes(timeline, 5) == timeline


# ---------------------------------------------------------------- `handoff report` on odd files


def _row(step, **fields):
    row = {"step": step, "reward_mean": 0.5, "reward_std": 0.1, "response_length": 3.0,
           "timing_s/gen": 1.0, "timing_s/step": 2.0, "switch/raw_s": 0.25}
    return {**row, **fields}


def _report_cli(run_dir):
    from typer.testing import CliRunner

    from handoff.cli import app

    result = CliRunner().invoke(app, ["report", str(run_dir)], terminal_width=300)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def _table_rows(output: str) -> list[list[str]]:
    """The cells of the metrics table's body rows."""
    return [[c.strip() for c in line.strip("│").split("│")] for line in output.splitlines()
            if line.startswith("│")]


def test_report_reads_blank_lines_duplicated_steps_and_missing_fields(tmp_path):
    import json

    from wrapped_text import flat

    lines = [json.dumps(_row(1)), "", "   ", json.dumps(_row(2, reward_mean=0.2)),
             json.dumps(_row(3, reward_mean=0.3)),
             # a resume from step 1 ran steps 2 and 3 again, and appended them
             json.dumps(_row(2, reward_mean=0.7)), json.dumps(_row(3, reward_mean=0.8)),
             json.dumps({k: v for k, v in _row(4).items() if k != "timing_s/gen"}),
             json.dumps({"step": 5, "reward_mean": 0.9, "switch/raw_s": None}), ""]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    result = _report_cli(tmp_path)
    assert result.exit_code == 0, result.output
    rows = _table_rows(result.output)
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5"]   # each step once, in order
    assert [r[1] for r in rows] == ["0.500", "0.700", "0.800", "0.500", "0.900"]  # later wins
    assert rows[3] == ["4", "0.500", "3.0", "-", "0.25s", "2.00"]   # the missing field: -
    assert rows[4] == ["5", "0.900", "-", "-", "-", "-"]
    said = flat(result.output)
    assert flat("steps 2, 3 appear more than once (a resumed run ran them again): the later "
                "record of each is shown") in said
    assert flat("2 row(s) lack 'timing_s/gen' (steps 4, 5): shown as -") in said
    assert "5steps" in said and "notacompletemetricsrow" not in said


def test_report_on_a_run_dir_that_is_missing_a_file_or_empty_is_one_line(tmp_path):
    for path, said in ((tmp_path / "nowhere", "holds no metrics.jsonl (no such directory)"),
                       (tmp_path / "a-file", "holds no metrics.jsonl (a file, not a run "
                                             "directory)"),
                       (tmp_path / "empty", "holds no metrics.jsonl: pass the run.out_dir")):
        if path.name == "a-file":
            path.write_text("x")
        elif path.name == "empty":
            path.mkdir()
        result = _report_cli(path)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert f"error: {path} {said}" in lines[0]
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n\n")
    result = _report_cli(tmp_path / "empty")
    assert result.exit_code == 0 and "holds no steps yet" in result.output, result.output


def test_report_names_a_switch_field_of_the_wrong_type(tmp_path):
    import json

    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1, **{"switch/exposed_s": "x"})))
    result = _report_cli(tmp_path)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "metrics.jsonl (step 1): field 'switch/exposed_s' is 'x', not a whole number or " \
           "number" in lines[0]


def _wake(step, seconds, nbytes):
    return {"step": step, "switch/kv_cache_wake/seconds": seconds,
            "switch/kv_cache_wake/bytes": nbytes}


def test_the_kv_wake_is_priced_at_the_rate_of_the_wake_before():
    planned = {"bytes": 100, "seconds": 4.0, "link": "map"}
    # Step 1 maps at 10 B/s, step 2 at 20 B/s, step 3 at 50 B/s: step 2 is priced at step 1's
    # rate, step 3 at step 2's; the summary's median covers steps 2-3, as the measured one.
    rows = [_wake(1, 5.0, 50), _wake(2, 2.0, 40), _wake(3, 1.0, 50)]
    priced = map_priced_at_last_wake(planned, rows)
    assert priced["seconds"] == pytest.approx((100 / 10 + 100 / 20) / 2)
    assert priced["start_seconds"] == 4.0
    assert priced["bytes"] == 100 and priced["link"] == "map"
    # A step after one that mapped nothing, or whose step before is missing (metrics.jsonl
    # cut short by hand), and a run of one step: the start's price.
    assert map_priced_at_last_wake(planned, [_wake(1, 0.0, 0), _wake(2, 1.0, 10)])["seconds"] == 4.0
    assert map_priced_at_last_wake(planned, [_wake(1, 5.0, 50), _wake(3, 1.0, 10)])["seconds"] == 4.0
    assert map_priced_at_last_wake(planned, [_wake(1, 5.0, 50)])["seconds"] == 4.0
    assert map_priced_at_last_wake(planned, [])["seconds"] == 4.0


def test_the_summary_says_how_the_wake_was_priced(tmp_path):
    cfg = _cfg("tiny-qwen3", tmp_path, "run.steps=2")
    report = RunReport(RunPlan.build(cfg), tmp_path, rates=Rates({**RATES, "remap_bytes": 2 ** 30}),
                       meter=MemoryMeter("cpu"), kv_pool_bytes=10 ** 9)
    report.start(0)
    for step, (secs, nbytes) in enumerate([(0.5, 10 ** 9), (0.25, 10 ** 9)], start=1):
        report.log_step({"step": step, "reward_mean": 0.0, "reward_std": 0.0,
                         "response_length": 1.0, "timing_s/gen": 0.0, "timing_s/step": 1.0,
                         **_wake(step, secs, nbytes)})
    summary = report.finish()
    wake = summary["planned"]["kv_cache_wake"]
    assert wake["seconds"] == pytest.approx(wake["bytes"] * 0.5 / 10 ** 9)
    assert summary["measured"]["kv_cache_wake"]["seconds"] == 0.25
    text = (tmp_path / "summary.md").read_text()
    assert "planned at the rate of the run's wake before" in text
    assert f"it was {wake['start_seconds']:.4f} s" in text
    console = Console(width=400, record=True)
    console.print(summary_table(summary))
    assert (f"kv_cache_wake planned at the run's wake before (at the start's rate "
            f"{wake['start_seconds']:.4f} s)") in console.export_text()
