"""User-facing errors: one line that names the cause and the fix."""


class HandoffError(ValueError):
    """A user error: bad input, a configuration that cannot work, a missing file.

    The message says what is wrong and what to do about it, in one line, e.g.
    "rollout.gpu_memory_utilization=1.5 is out of range (0, 1]: pass a value such as 0.85".
    """


class ConfigError(HandoffError):
    """A configuration field holds a value outside its accepted range or type."""


class RankError(HandoffError):
    """An error of one rank's own under torchrun (its device, its share of the work), even
    before the ranks first meet: every rank that has it prints it (dist.says_error)."""


def refuse_empty(path, flag: str, what: str) -> None:
    """One line for a path option given as "" (Path("") is the current directory: a model
    read from, or an export written into, wherever the command happened to run). A Path
    built from "" is "." already and passes: the CLI and the Python API hand strings."""
    if not str(path).strip():
        raise HandoffError(f"{flag} is empty: pass {what}")


def host_memory_error(error: BaseException) -> HandoffError | None:
    """One line for an allocation the host's RAM refused (torch's CPU allocator raises a
    RuntimeError, Python a MemoryError): which size, and what fits instead; None for any
    other error."""
    import re

    said = str(error)
    if not (isinstance(error, MemoryError) or (isinstance(error, RuntimeError)
                                               and "can't allocate memory" in said)):
        return None
    size = re.search(r"allocate (\d+) bytes", said)
    what = f" ({int(size.group(1)) / 1e9:.1f} GB at once)" if size else ""
    return HandoffError(f"out of host memory{what}: the model and its state do not fit this "
                        "machine's RAM; price a run first with `handoff plan --model MODEL "
                        "--hardware cpu`, and take a smaller model, LoRA (actor.lora.rank) or "
                        "a GPU")
