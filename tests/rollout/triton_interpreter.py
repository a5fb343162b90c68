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
