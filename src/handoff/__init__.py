"""handoff: colocated RL post-training with a measured memory handoff.

The trainer (FSDP2) and the rollout engine share one GPU and hand its memory back
and forth twice per step; `handoff plan` predicts every byte of that handoff and
`handoff train` measures it. See README.md for the two commands to start with.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`handoff.train`: the Python API (handoff/api.py), imported on first use so that
    `import handoff` stays light and the package root stays the lowest room."""
    if name == "train":
        import importlib

        return importlib.import_module("handoff.api").train
    raise AttributeError(f"module 'handoff' has no attribute {name!r}")
