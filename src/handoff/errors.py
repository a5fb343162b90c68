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
