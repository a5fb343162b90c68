"""`handoff train ARGS`, killed with SIGKILL at a chosen point (tests/test_crash_resume.py).

    python crash_run_job.py POINT N ARGS...    # dies at the N-th time the run reaches POINT

POINT: save (inside a checkpoint save: every shard written, no .metadata / meta.json yet),
metrics (half of a metrics row appended), prune (one file of a pruned checkpoint deleted),
publish (a complete checkpoint, `latest` not yet naming it), summary (after the last
checkpoint, before the summary), none (no kill). No cleanup runs: SIGKILL, as `kill -9`.
"""

import os
import signal
import sys


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _nth(n: int):
    seen = [0]

    def reached() -> bool:
        seen[0] += 1
        return seen[0] == n
    return reached


def arm(point: str, n: int) -> None:
    import torch.distributed.checkpoint as dcp

    import handoff.run_report as run_report
    import handoff.safe_files as safe_files
    from handoff.trainer import checkpoint

    reached = _nth(n)
    if point == "save":
        write_data = dcp.FileSystemWriter.write_data

        def save(self, *args, **kwargs):
            written = write_data(self, *args, **kwargs)
            if reached():
                written.wait()
                _die()
            return written
        dcp.FileSystemWriter.write_data = save
    elif point == "metrics":
        write = safe_files.os.write

        def metrics(fd, data):
            if reached():
                write(fd, data[: len(data) // 2])
                _die()
            return write(fd, data)
        safe_files.os.write = metrics
    elif point == "prune":
        rmtree = checkpoint.shutil.rmtree

        def prune(path, *args, **kwargs):
            if reached():
                files = sorted(e.path for e in os.scandir(path) if e.is_file())
                os.unlink(files[0])
                _die()
            return rmtree(path, *args, **kwargs)
        checkpoint.shutil.rmtree = prune
    elif point == "publish":
        replace_file = checkpoint.replace_file

        def publish(*args, **kwargs):
            if reached():
                _die()
            return replace_file(*args, **kwargs)
        checkpoint.replace_file = publish
    elif point == "summary":
        finish = run_report.RunReport.finish

        def summary(self):
            if reached():
                _die()
            return finish(self)
        run_report.RunReport.finish = summary
    elif point != "none":
        raise SystemExit(f"unknown point {point}")


if __name__ == "__main__":
    arm(sys.argv[1], int(sys.argv[2]))
    from handoff.cli import app

    sys.argv = ["handoff", *sys.argv[3:]]
    app()
