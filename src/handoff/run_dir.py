"""A run's output directory: who may write to it, and reading what a crash may have cut short.

    check_out_dir(cfg)                 # preflight, every rank: read-only, refuses a used out_dir
    lock = claim_out_dir(cfg)          # rank 0, before any file is written; lock.release()
    rows, problem = read_metrics(out_dir / "metrics.jsonl")

An out_dir holds a run when any of RUN_FILES is in it. A fresh start there is refused unless
the user asks to continue it (`--resume`) or to replace it (`--overwrite`, which removes those
files and nothing else), so an earlier run's metrics, summary, config and checkpoints are never
erased or mixed with a new run's without a word. The claim takes an exclusive `flock` on
`.handoff.lock` in out_dir: a second live run on the same out_dir is refused, and a run that
crashed holds nothing (the kernel drops the lock with the process). Only rank 0 claims: it
alone writes out_dir's files (the other ranks write their checkpoint shards, under its lead).

metrics.jsonl is appended one row per step, so a crash mid-write leaves a last line cut short:
`read_metrics` returns the rows before the first bad line and says which line it was, so
`handoff report` and `--resume` keep working. Every file is written through safe_files.py:
inside out_dir, never through a symbolic link (one planted where a run writes is refused).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from handoff.config import Config, dotted, to_dict
from handoff.errors import HandoffError
from handoff.model_files import is_run_config
from handoff.safe_files import failing_write_is_one_line, link_refused, open_fd, replace_file

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "summary.md",
             "memory_timeline.jsonl", "memory_timeline.png", "tensorboard", "checkpoints",
             "samples.jsonl", "wandb", "mlruns")
LOCK_FILE = ".handoff.lock"
# What a start writes before its first step: its lock, its config, its loggers' directories.
START_FILES = frozenset({LOCK_FILE, "config.json", "tensorboard", "wandb", "mlruns"})
# What a run that finished no step leaves (an error or a kill in its first step: the memory
# timeline says who held the card then): nothing trained, nothing to lose by replacing it.
NO_STEP_FILES = START_FILES | {"memory_timeline.jsonl"}
KEPT_CONFIG_PREFIX = "config.before-step-"   # a resume with changed settings keeps the old
# Every name a run writes in out_dir (and its temporary files): none may be a link.
WRITTEN = (*RUN_FILES, LOCK_FILE, *(f"{name}.tmp" for name in RUN_FILES[:6]),
           "samples.jsonl.tmp", "checkpoints/latest", "checkpoints/latest.tmp")

console = Console(stderr=True)


def earlier_run(out_dir: Path) -> list[str]:
    """The run files (RUN_FILES, and configs kept by a resume) already in out_dir."""
    kept = sorted(p.name for p in out_dir.glob(f"{KEPT_CONFIG_PREFIX}*.json"))
    return [name for name in RUN_FILES if (out_dir / name).exists()] + kept


def finished_no_step(found: list[str]) -> bool:
    """Whether an earlier run's files (earlier_run) are those of one that finished no step."""
    return bool(found) and set(found) <= NO_STEP_FILES


def holds_handoff_run(out_dir: Path) -> bool:
    """Whether out_dir's run files are a handoff run's: its lock file (written before any
    other) or a run's config.json. A model directory's config.json, or another tool's
    checkpoints/ or wandb/, are not: --overwrite must never remove them."""
    if (out_dir / LOCK_FILE).is_file():
        return True
    try:
        return is_run_config(json.loads((out_dir / "config.json").read_text()))
    except (OSError, ValueError, UnicodeDecodeError):
        return False


def check_out_dir(cfg: Config) -> None:
    """Refuse an out_dir that is not a directory, is the model's, holds files that are not a
    handoff run where a run would write, or holds a run this one would erase."""
    out = Path(cfg.run.out_dir)
    for where in (out, *out.parents):
        if where.exists() and not where.is_dir():
            raise HandoffError(f"run.out_dir={cfg.run.out_dir!r}: {where} is a file, not a "
                               "directory: point run.out_dir at a directory (created if missing)")
    if out.is_dir() and Path(cfg.model.path).is_dir() and out.samefile(cfg.model.path):
        raise HandoffError(f"run.out_dir={cfg.run.out_dir!r} is the model's directory "
                           "(model.path): a run's files would replace the model's; choose "
                           "another run.out_dir")
    for name in WRITTEN if out.is_dir() else ():
        if (out / name).is_symlink():
            raise link_refused(out / name)
    found = earlier_run(out) if out.is_dir() else []
    if found and not holds_handoff_run(out):
        raise HandoffError(f"run.out_dir={cfg.run.out_dir!r} holds files a run would write "
                           f"over ({', '.join(found)}) and they are not a handoff run's (no "
                           "run config.json): nothing was changed; choose another run.out_dir")
    if found and not (cfg.run.resume or cfg.run.overwrite or finished_no_step(found)):
        raise HandoffError(f"run.out_dir={cfg.run.out_dir!r} holds an earlier run "
                           f"({', '.join(found)}): pass --resume to continue it, --overwrite "
                           "(run.overwrite=true) to replace it, or choose another run.out_dir")


class RunLock:
    """An exclusive flock on out_dir's lock file, held until `release` or the process ends."""

    def __init__(self, out_dir: Path, *, created: bool = False):
        self._fd: int | None = None
        self.path = out_dir / LOCK_FILE
        self.created = created   # out_dir was made by this run
        with failing_write_is_one_line(self.path, "nothing was written"):
            fd = open_fd(self.path, out_dir, os.O_RDWR | os.O_CREAT)   # a planted link refused
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise HandoffError(f"run.out_dir={str(out_dir)!r} is in use by a live run (pid "
                               f"{owner}): wait for it to end, or choose another "
                               "run.out_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self, *, failed_start: bool = False,
                start_files: frozenset[str] = START_FILES) -> None:
        """Drop the lock; `failed_start`: a start refused before its first step removes the
        out_dir it made when it holds no more than `start_files` (the lock, the run's config,
        what a logger that could not start left), so no run that never ran is left to refuse
        the next."""
        if self._fd is None:
            return
        out = self.path.parent
        if failed_start and self.created and {p.name for p in out.iterdir()} <= start_files:
            # Removed under the lock (a start waiting on this out_dir must not have its own
            # files removed), the lock file last; a removal that fails must not hide the
            # start's own error.
            with contextlib.suppress(OSError):
                for path in out.iterdir():
                    if path.name == LOCK_FILE:
                        continue
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                self.path.unlink()
                out.rmdir()
        os.close(self._fd)   # closing the descriptor drops the flock
        self._fd = None

    def __del__(self) -> None:
        self.release()


def claim_out_dir(cfg: Config) -> RunLock:
    """Rank 0: create out_dir, lock it, check it again under the lock. An earlier run stays
    until `clear_earlier_run`, once every check of the start has passed."""
    check_out_dir(cfg)
    out = Path(cfg.run.out_dir)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HandoffError(f"cannot create run.out_dir={cfg.run.out_dir!r} ({e.strerror}): "
                           "choose a directory you can write to") from None
    # the lock file is the first thing written: a dir this run made holds it alone until then
    lock = RunLock(out, created=created)
    try:
        check_out_dir(cfg)   # a run that ended between the first check and the lock left files
    except BaseException:   # they are that run's: only this start's lock file goes
        lock.release(failed_start=True, start_files=frozenset({LOCK_FILE}))
        raise
    return lock


def clear_earlier_run(cfg: Config) -> None:
    """--overwrite, or an earlier run that finished no step (not resumed): remove the earlier
    run's files (RUN_FILES and nothing else), after every check of this start passed (a
    refused start loses nothing)."""
    out = Path(cfg.run.out_dir)
    found = earlier_run(out)
    if not (cfg.run.overwrite or (finished_no_step(found) and not cfg.run.resume)):
        return
    for name in found:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if found:
        why = "overwrite" if cfg.run.overwrite else "an earlier start that finished no step"
        console.print(f"[yellow]{why}: removed the earlier run's {', '.join(found)} "
                      f"from {escape(str(out))}[/]", highlight=False, soft_wrap=True)


def keep_changed_config(cfg: Config, step: int) -> None:
    """--resume (from `step`) with other settings than the run began with: say which, and keep
    the earlier config.json beside the new one (config.before-step-N.json), so what trained
    the earlier steps stays on record. A longer run.steps is a change only where the learning
    rate decays over the run (then the line says what it does to the next step's rate).

    A config already kept for `step` is what trained it: an earlier resume from the same step
    checkpointed nothing past it (it failed or was stopped first), and its config.json trained
    nothing that counts. The comparison is against the kept one, which stays."""
    out = Path(cfg.run.out_dir)
    kept = out / f"{KEPT_CONFIG_PREFIX}{step}.json"
    for source in (kept, out / "config.json"):
        try:
            before = json.loads(source.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if is_run_config(before):
            break
    else:
        return
    old, new = dotted(before), dotted(run_record(cfg))
    old["model.path"] = _absolute_if_local_dir(old.get("model.path"))   # an older run's record
    # A copied run directory is resumed where it now is: its out_dir is no change.
    ignored = {"run.resume", "run.overwrite", "run.out_dir"}
    if cfg.actor.lr_schedule == "constant":
        ignored.add("run.steps")   # a longer run: the lr of every step is as it was
    changed = [key for key in sorted(old.keys() | new.keys())
               if key not in ignored and old.get(key) != new.get(key)]
    if not changed:
        return
    if source != kept:
        with failing_write_is_one_line(kept, "the run's files are as they were"):
            replace_file(kept, json.dumps(before, indent=1).encode(), out)
    shown = ", ".join(f"{key} {old.get(key)!r} -> {new.get(key)!r}"
                      for key in changed[:6]) + (", ..." if len(changed) > 6 else "")
    lr = _lr_change(old, cfg, step) if "run.steps" in changed else ""
    console.print(f"[yellow]resume: settings changed since the run began: {escape(shown)}"
                  f"{escape(lr)} (the earlier config is kept as {kept.name})[/]",
                  highlight=False, soft_wrap=True)


def _absolute_if_local_dir(path: object) -> object:
    """model.path as config.json records it: a relative local directory made absolute."""
    if isinstance(path, str) and not Path(path).is_absolute() and Path(path).is_dir():
        return str(Path(path).resolve())
    return path


def _lr_change(old: dict, cfg: Config, step: int) -> str:
    """'; step N+1 trains at lr X (as begun: Y)': the next step's learning rate under the new
    run.steps against the run's own curve (its earlier config's lr, schedule, warm-up and
    updates per step); past the end of the earlier run, the rate its last step had."""
    from handoff.trainer.optim import LrSchedule

    a = cfg.actor

    def rate(lr, kind, warmup, per, steps, at_step) -> float | None:
        try:   # an earlier config with odd values: no comparison rather than a traceback
            total = steps * per
            k = min(at_step * per + 1, total)   # past the end: the rate of the last step
            return LrSchedule(float(lr), kind=kind, warmup_steps=warmup,
                              total_steps=total).lr_at(k)
        except (TypeError, ValueError, ZeroDivisionError):
            return None

    now = rate(a.lr, a.lr_schedule, a.warmup_steps, a.updates_per_step, cfg.run.steps, step)
    old_steps = old.get("run.steps")
    begun = rate(old.get("actor.lr"), old.get("actor.lr_schedule"), old.get("actor.warmup_steps"),
                 old.get("actor.updates_per_step"), old_steps, step)
    if now is None:
        return ""
    said = f"; step {step + 1} trains at lr {now:.3g}"
    if begun is None:
        return said
    if isinstance(old_steps, int) and step >= old_steps:
        return f"{said} (the run as begun ended at step {old_steps}, at lr {begun:.3g})"
    return f"{said} (as begun: {begun:.3g})"


def run_record(cfg: Config) -> dict:
    """The config as config.json records it: a model.path that is a local directory made
    absolute, so `handoff export` (run from anywhere) reads the model that trained, never
    another directory of the same relative name."""
    record = to_dict(cfg)
    record["model"]["path"] = _absolute_if_local_dir(cfg.model.path)
    return record


def write_run_config(cfg: Config) -> None:
    """config.json of the run (atomic: a crash leaves the old one or the new one)."""
    out = Path(cfg.run.out_dir)
    with failing_write_is_one_line(out / "config.json", "the run's files are as they were"):
        replace_file(out / "config.json", json.dumps(run_record(cfg), indent=1).encode(), out)


# ---------------------------------------------------------------- metrics.jsonl


def read_metrics(path: Path, *, required: tuple[str, ...] = ()) -> tuple[list[dict], str | None]:
    """(rows before the first bad line, a one-line note naming that line, or None).

    A row is a JSON object with an integer "step" and the `required` keys; anything else
    (a line cut short by a crash, bytes that are not JSON) ends the readable part."""
    rows: list[dict] = []
    lines = path.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if (not isinstance(row, dict) or type(row.get("step")) is not int
                or any(key not in row for key in required)):
            later = sum(1 for rest in lines[number:] if rest.strip())
            skipped = f"; {later} later line(s) skipped" if later else ""
            return rows, (f"{path} line {number} is not a complete metrics row (a write cut "
                          f"short by a crash?): using the {len(rows)} row(s) before it{skipped}")
        rows.append(row)
    return rows, None


def trim_metrics(out_dir: Path, start_step: int) -> list[dict]:
    """Keep the metrics rows of steps up to start_step (none on a fresh start), say what goes;
    returns the rows kept.

    Rows after a resumed checkpoint's step came from steps that never completed their
    checkpoint: dropped, so no step is counted twice. A summary goes too: until this run
    finishes, `handoff report` says it did not."""
    for name in ("summary.json", "summary.md"):
        (out_dir / name).unlink(missing_ok=True)
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows, problem = read_metrics(path)
    if problem:
        console.print(f"[yellow]{escape(problem)}[/]", highlight=False, soft_wrap=True)
    kept = [row for row in rows if row["step"] <= start_step]
    if len(kept) < len(rows):
        console.print(f"[yellow]resume: dropping {len(rows) - len(kept)} metrics row(s) after "
                      f"step {start_step}, the last checkpoint (their steps are run again)[/]",
                      highlight=False, soft_wrap=True)
    with failing_write_is_one_line(path, "metrics.jsonl is as it was"):
        replace_file(path, "".join(json.dumps(row) + "\n" for row in kept).encode(), out_dir)
    return kept


def last_logged_step(out_dir: Path) -> int:
    """The last step metrics.jsonl records (0: none, or no file)."""
    path = out_dir / "metrics.jsonl"
    rows, _ = read_metrics(path) if path.is_file() else ([], None)
    return max((row["step"] for row in rows), default=0)


def resume_point(out_dir: Path) -> tuple[Path | None, bool]:
    """(the checkpoint `--resume` continues from, whether it stands in for a missing
    `latest`): `latest`, else the newest complete one a logged step published (one past
    the last logged step never counted; metrics.jsonl is read only then). Read on one
    rank: callers broadcast it."""
    from handoff.trainer.checkpoint import latest_checkpoint, newest_complete_checkpoint

    root = out_dir / "checkpoints"
    latest = latest_checkpoint(root)
    if latest is not None:
        return latest, False
    stand_in = newest_complete_checkpoint(root, at_most=last_logged_step(out_dir))
    return stand_in, stand_in is not None


# ---------------------------------------------------------------- an interrupted run


def resume_command(config: str, overrides: list[str], env: dict | None = None) -> str:
    """`handoff train` as the user gave it, quoted for a shell: the config and every override,
    less run.resume / run.overwrite (--resume is added; with --overwrite it is refused).
    Under torchrun (its variables in `env`, default os.environ) the launcher comes first,
    with the processes per node it started (and the nodes: their rendezvous is the user's)."""
    kept = [o for o in overrides
            if o.partition("=")[0].strip() not in ("run.resume", "run.overwrite")]
    command = shlex.join(["handoff", "train", config, *kept])
    env = os.environ if env is None else env
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if not (world.isdigit() and local.isdigit() and int(local) >= 1):
        return command
    launcher = f"torchrun --nproc-per-node {local}"
    if int(world) > int(local):
        launcher = (f"torchrun --nnodes {int(world) // int(local)} --nproc-per-node {local} "
                    "<this launch's rendezvous options>")
    return f"{launcher} -m {command}"


def interrupted_message(cfg: Config, command: str) -> str:
    """What a run stopped by Ctrl-C can resume from, and how (one line); `command` is
    resume_command's."""
    from handoff.trainer.checkpoint import checkpoint_step

    if not cfg.run.checkpoint:
        return ("interrupted: this run keeps no checkpoints (run.checkpoint=false): nothing to "
                "resume")
    try:
        latest, _ = resume_point(Path(cfg.run.out_dir))
        if latest is not None:
            step = checkpoint_step(latest)
    except HandoffError as e:
        return f"interrupted; its checkpoints cannot be resumed: {e}"
    if latest is None:
        return (f"interrupted before the first checkpoint: `{command} --resume` starts again "
                "at step 0")
    return (f"interrupted: the run can resume from step {step} ({latest}) "
            f"with `{command} --resume`")
