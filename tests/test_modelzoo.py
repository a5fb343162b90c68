"""handoff init-model: what it refuses before building anything."""


def test_init_model_refuses_a_preset_larger_than_host_ram(tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app

    result = CliRunner().invoke(app, ["init-model", "--preset", "deepseek-v3", "--out",
                                      str(tmp_path / "m")])
    assert result.exit_code == 2
    assert "needs" in result.output and "host RAM" in result.output
    assert not (tmp_path / "m").exists()


def test_init_model_refuses_a_dangling_link_as_out(tmp_path):
    from typer.testing import CliRunner

    from handoff.cli import app

    (tmp_path / "m").symlink_to(tmp_path / "nowhere")
    result = CliRunner().invoke(app, ["init-model", "--preset", "tiny-qwen3", "--out",
                                      str(tmp_path / "m")], terminal_width=300)
    assert result.exit_code == 2 and "symbolic link to nothing" in result.output
    assert not (tmp_path / "nowhere").exists()
