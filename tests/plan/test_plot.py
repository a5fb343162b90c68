"""`handoff plan --plot`: the utilization sweep drawn from the same report as the tables."""

from typer.testing import CliRunner

from handoff.cli import app


def test_plan_plot_writes_the_sweep(tmp_path):
    out = tmp_path / "sweep.png"
    result = CliRunner().invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8",
                                      "--hardware", "h100-sxm", "--util", "0.6", "--json",
                                      "--plot", str(out)])
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plan_plot_is_drawn_for_a_plan_that_does_not_fit(tmp_path):
    """The whole plan is the answer then too (exit 3), the sweep with its empty pools."""
    out = tmp_path / "sweep.png"
    result = CliRunner().invoke(app, ["plan", "--model", "qwen3-32b", "--gpus", "1",
                                      "--hardware", "h100-sxm", "--plot", str(out)])
    assert result.exit_code == 3, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_plot_to_another_format_is_one_line_before_planning(tmp_path):
    out = tmp_path / "sweep.txt"
    result = CliRunner().invoke(app, ["plan", "--model", "qwen3-8b", "--plot", str(out)],
                                terminal_width=300)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "not a .png path" in lines[0]
    assert not out.exists()


def test_plan_plot_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch):
    """Under a file, or in a read-only directory: the one line names --plot and the fix."""
    import errno

    from matplotlib.figure import Figure

    (tmp_path / "rewards.py").write_text("")
    under_file = tmp_path / "rewards.py" / "k.png"
    result = CliRunner().invoke(app, ["plan", "--model", "tiny-qwen3", "--plot",
                                      str(under_file)], terminal_width=400)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: --plot '{under_file}' cannot be written: a file stands")
    assert lines[0].endswith("pass a .png path in a directory you can write to")

    def read_only(self, path, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(Figure, "savefig", read_only)
    out = tmp_path / "k.png"
    result = CliRunner().invoke(app, ["plan", "--model", "tiny-qwen3", "--plot", str(out)],
                                terminal_width=400)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: --plot '{out}' is not writable (read-only")
