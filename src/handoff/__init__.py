"""handoff: colocated RL post-training with a measured memory handoff.

The trainer (FSDP2) and the rollout engine share one GPU and hand its memory back
and forth twice per step; `handoff plan` predicts every byte of that handoff and
`handoff train` measures it. See README.md for the two commands to start with.
"""

__version__ = "0.1.0"
