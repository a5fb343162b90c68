"""Run a Triton kernel test module's own __main__ under TRITON_INTERPRET=1, on CPU.

The variable must be set before Triton decorates the kernels, and the other test modules
import Triton normally, so the module runs in ONE subprocess and prints its results as JSON
on a line that starts with "RESULTS ". Skipped (pytest's own reason) without triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def results_under_interpreter(script: str) -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


def fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns a run-time loop
    bound into an int with int(array), which numpy >= 2.4 refuses; read the element instead."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
