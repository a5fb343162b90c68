"""A run writes only inside its out_dir, never through a symbolic link (one planted where it
writes is refused in one line, its target untouched), and a write that fails (a full disk, an
out_dir it cannot write) is one line that truncates nothing."""

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from handoff.calibrate import Rates
from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.loggers.samples import append_samples, trim_samples
from handoff.memory.meter import MemoryMeter, plot_timeline
from handoff.run_dir import RunLock, check_out_dir, trim_metrics, write_run_config
from handoff.run_report import RunReport
from handoff.runplan import RunPlan
from handoff.trainer.checkpoint import publish_checkpoint

PRECIOUS = b"the user's own file, outside out_dir\n"


def _cfg(out, *extra):
    return load_config("examples/cpu-tiny.yaml", ["model.path=tiny-qwen3", f"run.out_dir={out}",
                                                  "run.steps=3", *extra])


def _report(out):
    rates = Rates({"d2h_bps": 5e9, "h2d_bps": 5e9, "d2d_bps": 20e9})
    return RunReport(RunPlan.build(_cfg(out)), out, rates=rates, meter=MemoryMeter("cpu"),
                     kv_pool_bytes=0)


def _finish(out):
    report = _report(out)
    report.rows = [_row(1)]
    return report.finish()


def _row(step):
    return {"step": step, "reward_mean": 0.5, "reward_std": 0.0, "response_length": 1.0,
            "timing_s/gen": 0.1, "timing_s/step": 0.2}


def _plant(out: Path, name: str, outside: Path, *, dangling: bool) -> Path:
    """A link at out/name to a file outside out_dir (or to where one would be created)."""
    target = outside / ("absent" if dangling else "precious")
    if not dangling:
        target.write_bytes(PRECIOUS)
    link = out / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return target


def _checkpoint_dir(out: Path) -> Path:
    step = out / "checkpoints" / "step_00000001_ab"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 1}')
    return step


WRITERS = {
    ".handoff.lock": lambda out: RunLock(out),
    "config.json.tmp": lambda out: write_run_config(_cfg(out)),
    "metrics.jsonl.tmp": lambda out: trim_metrics(out, 0),
    "metrics.jsonl": lambda out: _report(out).log_step(_row(1)),
    "summary.json.tmp": _finish,
    "memory_timeline.jsonl.tmp": lambda out: MemoryMeter("cpu").write_jsonl(
        out / "memory_timeline.jsonl"),
    "memory_timeline.png.tmp": lambda out: plot_timeline([], out / "memory_timeline.png"),
    "checkpoints/latest.tmp": lambda out: publish_checkpoint(_checkpoint_dir(out)),
    "tensorboard": lambda out: _report(out).start(0),
    "samples.jsonl": lambda out: append_samples(out / "samples.jsonl", [{"step": 1}]),
    "samples.jsonl.tmp": lambda out: trim_samples(out / "samples.jsonl", 0),
}


@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.parametrize("dangling", [False, True], ids=["to a file", "dangling"])
def test_a_link_planted_where_a_run_writes_is_refused_and_its_target_untouched(tmp_path, name,
                                                                             dangling):
    out, outside = tmp_path / "run", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    if name in ("metrics.jsonl.tmp", "samples.jsonl.tmp"):
        (out / name.removesuffix(".tmp")).write_text(json.dumps(_row(1)) + "\n")
    if name == "tensorboard":   # a linked directory
        target = outside / "tb"
        if not dangling:
            target.mkdir()
        (out / "tensorboard").symlink_to(target, target_is_directory=True)
    else:
        target = _plant(out, name, outside, dangling=dangling)
    # Before any work: the preflight's check of out_dir names the link.
    with pytest.raises(HandoffError, match="is a symbolic link") as e:
        check_out_dir(_cfg(out, "run.resume=true"))
    assert str(out / name) in str(e.value) and "\n" not in str(e.value)
    # A link planted after that check (mid-run) is refused by the write itself.
    with pytest.raises(HandoffError, match="is a symbolic link: a run writes its files inside "
                                           "run.out_dir and never through a link") as e:
        lock = WRITERS[name](out)
    assert str(out / name) in str(e.value)
    if dangling:
        assert not os.path.lexists(target) or target.is_dir() and not any(target.iterdir())
    elif target.is_dir():
        assert not any(target.iterdir())
    else:
        assert target.read_bytes() == PRECIOUS
    assert (out / name).is_symlink()


def test_a_linked_subdirectory_of_out_dir_is_refused_for_every_name(tmp_path):
    out, outside = tmp_path / "run", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (out / "checkpoints").symlink_to(outside, target_is_directory=True)
    with pytest.raises(HandoffError, match="checkpoints is a symbolic link"):
        check_out_dir(_cfg(out, "run.resume=true"))
    from handoff.safe_files import make_dirs, replace_file

    for write in (lambda: make_dirs(out / "checkpoints" / "x", out),
                  lambda: replace_file(out / "checkpoints" / "latest", b"x", out)):
        with pytest.raises(HandoffError, match="checkpoints is a symbolic link"):
            write()
    assert list(outside.iterdir()) == []


def _metrics_with_rows(out: Path, steps: int) -> bytes:
    data = "".join(json.dumps(_row(s)) + "\n" for s in range(1, steps + 1)).encode()
    (out / "metrics.jsonl").write_bytes(data)
    return data


def _half_then_enospc(real_write):
    def write(fd, data):
        real_write(fd, bytes(data)[: len(data) // 2])   # a short write, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


def test_a_full_disk_while_appending_metrics_is_one_line_and_keeps_the_earlier_rows(
        tmp_path, monkeypatch):
    import handoff.safe_files as safe_files

    before = _metrics_with_rows(tmp_path, 2)
    report = _report(tmp_path)
    report.rows = [_row(1), _row(2)]
    monkeypatch.setattr(safe_files.os, "write", _half_then_enospc(os.write))
    with pytest.raises(HandoffError) as e:
        report.log_step(_row(3))
    text = str(e.value)
    assert "\n" not in text and str(tmp_path / "metrics.jsonl") in text
    assert "the disk is full" in text and "metrics.jsonl keeps its 2 row(s)" in text
    assert "resume with --resume" in text
    assert (tmp_path / "metrics.jsonl").read_bytes() == before   # the half row cut back
    assert len(report.rows) == 2


class FullDiskLoggers:
    """run.loggers (TensorBoard's writer) on a full disk."""

    def log_metrics(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    log_samples = close = log_metrics


def test_a_full_disk_while_writing_tensorboard_is_one_line(tmp_path):
    before = _metrics_with_rows(tmp_path, 1)
    report = _report(tmp_path)
    report.rows = [_row(1)]
    report._loggers = FullDiskLoggers()
    with pytest.raises(HandoffError, match="tensorboard could not be written \\(the disk is "
                                           "full: No space left on device\\)"):
        report.log_step(_row(2))
    with pytest.raises(HandoffError, match="tensorboard could not be written"):
        report.log_samples(2, [("p", "c", 1.0)])
    with pytest.raises(HandoffError, match="tensorboard could not be written"):
        report.finish()
    assert (tmp_path / "metrics.jsonl").read_bytes().startswith(before)


@pytest.mark.parametrize("name", ["memory_timeline.jsonl", "memory_timeline.png",
                                  "summary.json", "config.json", "checkpoints/latest"])
def test_a_full_disk_while_replacing_a_file_keeps_the_old_one_whole(tmp_path, monkeypatch, name):
    import handoff.safe_files as safe_files

    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_bytes(b"the earlier version\n")

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safe_files.os, "fsync", fsync)
    write = {"memory_timeline.jsonl": lambda: _finish(tmp_path),
             "memory_timeline.png": lambda: _finish(tmp_path),
             "summary.json": lambda: _finish(tmp_path),
             "config.json": lambda: write_run_config(_cfg(tmp_path)),
             "checkpoints/latest": lambda: publish_checkpoint(_checkpoint_dir(tmp_path))}[name]
    with pytest.raises(HandoffError, match="could not be written \\(the disk is full") as e:
        write()
    assert "\n" not in str(e.value)
    assert (tmp_path / name).read_bytes() == b"the earlier version\n"
    assert not list(tmp_path.rglob("*.tmp"))


@contextlib.contextmanager
def _cannot_write(out: Path):
    """out_dir read-only to this process: chmod, and a process that is not root (root
    ignores modes: it takes nobody's uid for the block)."""
    modes = {p: p.stat().st_mode for p in [out, *out.iterdir()]}
    for p in modes:
        p.chmod(0o555 if p.is_dir() else 0o444)
    root = os.geteuid() == 0
    try:
        if root:
            os.seteuid(65534)
        yield
    finally:
        if root:
            os.seteuid(0)
        for p, mode in modes.items():
            p.chmod(mode)


def test_an_out_dir_the_run_cannot_write_is_one_line_and_keeps_every_byte():
    base = Path(tempfile.mkdtemp(dir="/tmp"))   # traversable by the uid the block takes
    try:
        base.chmod(0o755)
        out = base / "run"
        out.mkdir()
        before = _metrics_with_rows(out, 2)
        (out / "memory_timeline.jsonl").write_bytes(b"{}\n")
        report = _report(out)
        report.rows = [_row(1), _row(2)]
        with _cannot_write(out):
            with pytest.raises(HandoffError) as e:
                report.log_step(_row(3))
            with pytest.raises(HandoffError, match="memory_timeline.jsonl could not be written "
                                                   "\\(run.out_dir is not writable"):
                _finish(out)
        text = str(e.value)
        assert "run.out_dir is not writable" in text and "metrics.jsonl keeps its 2 row(s)" in text
        assert (out / "metrics.jsonl").read_bytes() == before
        assert (out / "memory_timeline.jsonl").read_bytes() == b"{}\n"
    finally:
        shutil.rmtree(base)


def test_a_full_disk_mid_run_is_one_line_from_handoff_train(tmp_path, monkeypatch):
    import handoff.safe_files as safe_files
    from typer.testing import CliRunner

    from handoff.cli import app
    from handoff.modelzoo import init_model
    from handoff.run_dir import read_metrics
    from handoff.trainer.checkpoint import checkpoint_step, latest_checkpoint

    model = init_model("tiny-qwen3", tmp_path / "model", dtype="float32")
    appended = []
    write = os.write

    def full_at_the_second_row(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            appended.append(1)
        if len(appended) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(safe_files.os, "write", full_at_the_second_row)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", "examples/cpu-tiny.yaml", f"model.path={model}",
                                   f"run.out_dir={out}", "run.steps=3", "run.save_every=1"],
                             terminal_width=400)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in res.output
    assert f"{out / 'metrics.jsonl'} could not be written (the disk is full" in errors[0]
    assert "metrics.jsonl keeps its 1 row(s)" in errors[0]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")[0]] == [1]
    assert checkpoint_step(latest_checkpoint(out / "checkpoints")) == 1   # step 2's unpublished
