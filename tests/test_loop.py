"""The loop's edge cases on CPU: a fresh start in a used out_dir (overwritten or resumed),
offloads and the ref off."""

import gc
import json

import pytest

from handoff.config import load_config
from handoff.loop import Run
from handoff.modelzoo import init_model
from handoff.plan.ledger import SWITCH_ACTIONS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("edges-model"), dtype="float32")


def _cfg(model_dir, out_dir, *extra):
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model_dir}",
                                                   f"run.out_dir={out_dir}", *extra])


@pytest.mark.parametrize("how", ["run.overwrite=true", "run.resume=true"])
def test_fresh_start_drops_an_earlier_runs_metrics(model_dir, tmp_path, how, capsys):
    # An earlier run (no checkpoint published, e.g. run.checkpoint=false or killed in step 1)
    # left rows; this run starts at step 0, so appending to them would count steps twice.
    # (Without --resume or --overwrite the out_dir is refused: tests/test_run_dir.py.)
    stale = "".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(stale)
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / ".handoff.lock").touch()   # a handoff run's (its lock is written first)
    trainer = Run(_cfg(model_dir, tmp_path, how))
    assert trainer.start_step == 0
    metrics = tmp_path / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""
    # The earlier run's summary would make `handoff report` call this unfinished run done.
    assert not (tmp_path / "summary.json").exists()
    # A resume that finds nothing to resume from says so instead of silently restarting,
    # and says which rows it drops; an overwrite says what it removed.
    out = capsys.readouterr()
    resume = how == "run.resume=true"
    assert ("no complete checkpoint" in out.out) == resume
    assert ("dropping 3 metrics row(s)" in out.err) == resume
    assert ("overwrite: removed the earlier run's metrics.jsonl, summary.json" in out.err) == (
        not resume)


def test_offloads_and_ref_off_still_report_every_action(model_dir, tmp_path):
    trainer = Run(_cfg(model_dir, tmp_path, "memory.param_offload=false",
                           "memory.optimizer_offload=false", "memory.ref_offload=false",
                           "actor.kl_coef=0"))
    assert trainer.worker.ref is None
    row = trainer.step(0)
    for action in SWITCH_ACTIONS:
        assert f"switch/{action}/seconds" in row and f"switch/{action}/bytes" in row
    for action in ("params_d2h", "params_h2d", "optimizer_d2h", "optimizer_h2d",
                   "ref_h2d", "ref_d2h"):
        assert row[f"switch/{action}/bytes"] == 0
    assert row["switch/engine_weights_sync/bytes"] > 0
    # The sync action splits into the weights' map and the copies, each inside it.
    parts = row["sync/wake_s"] + row["sync/copy_s"]
    assert 0 < row["sync/host_s"] <= row["sync/copy_s"]
    assert 0 < parts <= row["switch/engine_weights_sync/seconds"]


def test_steps_run_with_the_setup_heap_frozen(model_dir, tmp_path, monkeypatch):
    # The switch's gc.collect() calls must not walk the setup's objects (torch, transformers,
    # the models: ~200 ms per call on a 2-core host); the run unfreezes the heap at its end.
    trainer = Run(_cfg(model_dir, tmp_path, "run.steps=1", "run.checkpoint=false"))
    engine_id = id(trainer.worker.engine)
    seen = []
    plain = trainer.worker.to_rollout
    monkeypatch.setattr(trainer.worker, "to_rollout",
                        lambda: seen.append({id(o) for o in gc.get_objects()}) or plain())
    trainer.run()
    assert seen and engine_id not in seen[0]   # frozen objects are outside the collector's view
    assert gc.get_freeze_count() == 0
    assert engine_id in {id(o) for o in gc.get_objects()}


def test_benchmark_lengths_and_rates_from_an_earlier_run(model_dir, tmp_path, monkeypatch):
    """rollout.response_lengths gives each sample its own length (EOS ignored) and the row
    reports the engine's step; run.rates_file prices the ledger with an earlier run's rates
    and skips the start-up measurements."""
    import handoff.startup as startup

    first = Run(_cfg(model_dir, tmp_path / "a", "run.steps=1", "run.checkpoint=false",
                     "rollout.max_tokens=8", "rollout.response_lengths=uniform:min=1,max=6"))
    summary = first.run()
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= rows[0]["response_length"] <= 6
    assert rows[0]["engine/kv_blocks"] > 0 and rows[0]["engine/peak_running"] > 0
    assert rows[0]["engine/decode_steps"] == 5   # the longest sample: 6 tokens, one by prefill
    assert rows[0]["prompt_length"] > 0
    # the decode against its HBM floor: what it read at the least over the measured copy rate
    floor = rows[0]["engine/decode_read_bytes"] / summary["rates"]["d2d_bps"]
    assert rows[0]["engine/decode_over_floor"] == pytest.approx(rows[0]["engine/decode_s"] / floor)
    assert summary["decode_over_floor"] == rows[0]["engine/decode_over_floor"]
    assert "its HBM floor" in (tmp_path / "a" / "summary.md").read_text()
    monkeypatch.setattr(startup, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    second = Run(_cfg(model_dir, tmp_path / "b", "run.steps=1", "run.checkpoint=false",
                      f"run.rates_file={tmp_path / 'a' / 'summary.json'}"))
    assert second.rates.values == summary["rates"]
    from handoff.errors import HandoffError

    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(HandoffError, match="no measured rates"):
        Run(_cfg(model_dir, tmp_path / "c", f"run.rates_file={tmp_path / 'bad.json'}"))


def test_each_evaluation_problem_draws_its_own_stream_whatever_the_ranks():
    from handoff.rollout.sampling import SamplingParams, seeded_per_prompt

    params = SamplingParams(temperature=0.7, n=1, max_tokens=4, seed=None)
    whole = seeded_per_prompt(params, 3, [0, 1, 2, 3])
    assert len({p.seed for p in whole}) == 4   # one stream per problem
    assert all(p.temperature == 0.7 and p.max_tokens == 4 for p in whole)
    # rank 1 of 2 evaluates problems 1 and 3: the same seeds as one rank gives them
    assert [p.seed for p in seeded_per_prompt(params, 3, [1, 3])] == [whole[1].seed,
                                                                      whole[3].seed]
    assert seeded_per_prompt(params, 4, [0])[0].seed != whole[0].seed   # run.seed decides them
