"""`handoff init-model` input errors: one line and exit 2, never a traceback."""

import pytest
import torch
from typer.testing import CliRunner

from handoff.cli import app


def _init(tmp_path, *extra):
    return CliRunner().invoke(app, ["init-model", "--preset", "tiny-qwen3",
                                    "--out", str(tmp_path / "m"), *extra])


def test_unknown_dtype_is_one_line(tmp_path):
    result = _init(tmp_path, "--dtype", "foo")
    assert result.exit_code == 2 and "use bfloat16, float16 or float32" in result.output
    assert not (tmp_path / "m").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_one_line(tmp_path):
    result = _init(tmp_path, "--device", "cuda")
    assert result.exit_code == 2 and "torch sees no GPU" in result.output
