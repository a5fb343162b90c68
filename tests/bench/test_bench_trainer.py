"""`handoff bench trainer` on CPU with a tiny model: every part's bytes equal the ledger's."""

from handoff.bench.trainer import ORDER, run_trainer_bench
from handoff.modelzoo import init_model
from handoff.plan.shapes import PRESETS, count_params


def test_bench_bytes_equal_the_plan_ledger(tmp_path):
    ckpt = str(init_model("tiny-qwen3", tmp_path / "m", dtype="bfloat16"))
    result = run_trainer_bench(ckpt, device="cpu", repeats=1, rows=4, seq_len=16, micro_batch=2)
    n = count_params(PRESETS["tiny-qwen3"])
    assert result["num_params"] == n
    assert [a["action"] for a in result["actions"]] == [name for name, *_ in ORDER]
    want = {"optimizer_d2h": 12 * n, "params_d2h": 2 * n, "ref_d2h": 2 * n,
            "params_h2d": 2 * n, "optimizer_h2d": 12 * n, "ref_h2d": 2 * n}
    for a in result["actions"]:
        assert a["bytes"] == a["ledger_bytes"] == want[a["action"]] and a["bytes_match"]
    assert result["update_metrics"]["num_tokens"] == 4 * 14


def test_rows_that_are_not_whole_groups_name_the_option_typed(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import handoff.bench.trainer as trainer
    from handoff.cli import app

    def not_built(*args, **kwargs):
        raise AssertionError("the model was built before --rows was checked")

    monkeypatch.setattr(trainer, "build_actor", not_built)
    ckpt = str(init_model("tiny-qwen3", tmp_path / "m", dtype="float32"))
    for rows, fix in ((6, "--rows 8"), (2, "--rows 4"), (13, "--rows 16")):
        result = CliRunner().invoke(app, ["bench", "trainer", "--model", ckpt, "--device", "cpu",
                                          "--rows", str(rows), "--out", str(tmp_path / "o.json")],
                                    terminal_width=300)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert lines[0].startswith(f"error: --rows {rows} is not a multiple of 4"), lines[0]
        assert fix in lines[0] and "rollout.n" not in lines[0]
        assert not (tmp_path / "o.json").exists()
