"""Writing a run's files inside its out_dir: never through a symbolic link, never half.

    with open_for_writing(out_dir / "metrics.jsonl", out_dir, append=True) as f: ...
    replace_file(out_dir / "summary.json", text.encode(), out_dir)   # tmp + fsync + rename
    make_dirs(out_dir / "checkpoints", out_dir)
    with failing_write_is_one_line(path, "metrics.jsonl keeps its rows"): ...

Every directory from `root` down to the file is opened with O_NOFOLLOW (through directory
descriptors, so nothing can be swapped for a link between a check and the write), and so is
the file: a link planted where a run writes (`.handoff.lock`, `config.json.tmp`, a dangling
`metrics.jsonl`, `checkpoints/latest.tmp`, a linked `checkpoints/`) is refused in one line
naming it, and its target is never truncated, overwritten or appended to. `root` itself may
be a link: the user chose it as run.out_dir.

A write that fails (a full disk, a read-only directory) is one line naming the file, the
cause and what is intact (`write_failed`); `replace_file` leaves the old file whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import BinaryIO

from handoff.errors import HandoffError

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def link_refused(path: Path) -> HandoffError:
    """The one line for a symbolic link where a run writes."""
    return HandoffError(f"{path} is a symbolic link: a run writes its files inside run.out_dir "
                        "and never through a link (its target would be overwritten); remove "
                        "the link, or choose another run.out_dir")


def write_failed(path: Path, error: OSError, intact: str) -> HandoffError:
    """One line for a write that failed: the file, the cause and its fix, what is intact."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        cause, fix = "the disk is full", "free some space"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause, fix = "run.out_dir is not writable", "make it writable"
    else:
        cause, fix = "the write failed", "fix the file system"
    return HandoffError(f"{path} could not be written ({cause}: {error.strerror or error}); "
                        f"{intact}: {fix} and resume with --resume")


@contextlib.contextmanager
def failing_write_is_one_line(path: Path, intact: str) -> Iterator[None]:
    """An OSError inside the block becomes write_failed's one line, naming `path` (or the
    error's own file, where it names another by its full path: one a logger writes)."""
    try:
        yield
    except OSError as e:
        own = str(e.filename or "")
        named = Path(own) if os.path.isabs(own) and not own.startswith(str(path)) else path
        raise write_failed(named, e, intact) from None


def _relative(path: Path, root: Path) -> list[str]:
    parts = Path(os.path.abspath(path)).relative_to(os.path.abspath(root)).parts
    if not parts or ".." in parts:
        raise ValueError(f"{path} is not a file inside {root}")
    return list(parts)


@contextlib.contextmanager
def _dir_fd(root: Path, parts: list[str], *, create: bool) -> Iterator[int]:
    """A descriptor of root/parts[0]/... opened one level at a time without following links."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, name in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
            try:
                inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(
                        root.joinpath(*parts[:i + 1])):
                    raise link_refused(root.joinpath(*parts[:i + 1])) from None
                raise
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def make_dirs(path: Path, root: Path) -> None:
    """Create `path` and its parents under `root` (none of them a link)."""
    with _dir_fd(root, _relative(path, root), create=True):
        pass


def _open_in(parent: int, name: str, shown: Path, flags: int, mode: int = 0o644) -> int:
    try:
        return os.open(name, flags | _NOFOLLOW, mode, dir_fd=parent)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(shown) from None
        raise


def open_fd(path: Path, root: Path, flags: int, mode: int = 0o644) -> int:
    """os.open of a file under `root`, no link followed on the way or at the end."""
    *dirs, name = _relative(path, root)
    with _dir_fd(root, dirs, create=False) as parent:
        return _open_in(parent, name, path, flags, mode)


@contextlib.contextmanager
def open_for_writing(path: Path, root: Path, *, append: bool = False) -> Iterator[BinaryIO]:
    """A binary file under `root` for writing (truncated, or appended to with `append`)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    with os.fdopen(open_fd(path, root, flags), "wb") as f:
        yield f


def append_line(path: Path, root: Path, data: bytes) -> None:
    """Append `data` whole or not at all: a failed write is cut back to the size before it."""
    fd = open_fd(path, root, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, root: Path) -> None:
    """Write `data` to path.tmp, fsync, rename over `path`: a failure leaves the old file.
    A link at `path` is replaced (its target untouched); one at path.tmp is refused."""
    *dirs, name = _relative(path, root)
    tmp = name + ".tmp"
    with _dir_fd(root, dirs, create=False) as parent:
        fd = _open_in(parent, tmp, path.with_name(tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)   # our own file: the open above refused a link
            raise
        os.fsync(parent)


def usual_mode(*paths: Path) -> None:
    """Give files a library created owner-only (safetensors writes 0600) the mode every other
    file gets (0666 less the umask), so an exported or converted model is readable as a
    downloaded one is."""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


# ---------------------------------------------------------------- a model directory written whole


def first_missing(path: Path) -> Path | None:
    """The topmost directory of `path` (itself or a parent) that does not exist yet: what a
    write that creates `path` makes, and removes again when it fails (None: `path` exists)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            return missing
        missing = p
    return missing


def publish(staging: Path, out: Path, replaces: Collection[str] = ()) -> None:
    """Move the files staged in `staging` into `out`; earlier weight shards go (a loader would
    read them), and the files named in `replaces` (what an earlier write of the same kind
    put there). A link at a file's name in `out` is replaced, never followed."""
    for old in out.iterdir():
        # model_files.WEIGHTS_INDEX, named here: the two are peers, neither imports the other
        if old.name.endswith(".safetensors") or old.name == "model.safetensors.index.json":
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        elif old.name in replaces and (old.is_file() or old.is_symlink()):
            old.unlink()   # a file only: a directory of that name is not the earlier write's
    for new in sorted(staging.iterdir()):
        target = out / new.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(new, target)
    staging.rmdir()


@contextlib.contextmanager
def safetensors_os_errors(path: Path) -> Iterator[None]:
    """A safetensors write that failed (its Rust side says "os error N") raised as the OSError
    it was, naming `path`, for the caller's one line."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def cannot_write(what: str, error: OSError, fix: str) -> HandoffError:
    """One line for a write outside a run's out_dir that failed (a model directory, the
    handoff cache, a plot): `what`, the cause, and `fix`."""
    said = f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return HandoffError(f"{what} cannot be written: the disk is full ({said}): free space "
                            f"there, or {fix}")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return HandoffError(f"{what} is not writable (read-only, or owned by another user: "
                            f"{said}): {fix}")
    if error.errno in (errno.EEXIST, errno.ENOTDIR):   # mkdir met a file on the way
        return HandoffError(f"{what} cannot be written: a file stands where a directory goes "
                            f"({said}): {fix}")
    return HandoffError(f"{what} cannot be written ({said}): {fix}")
