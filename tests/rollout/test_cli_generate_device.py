"""`handoff generate --device`: a wrong or unavailable device is one line (exit 2)."""

import pytest
import torch
from typer.testing import CliRunner

from handoff.cli import app


def _generate(model, device):
    return CliRunner().invoke(app, ["generate", "--model", str(model), "--prompt", "hi",
                                    "--max-tokens", "2", "--device", device])


def test_unknown_device_name_is_one_line(qwen3_dir):
    result = _generate(qwen3_dir, "bogus")
    assert result.exit_code == 2 and "use cpu or cuda" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_one_line(qwen3_dir):
    result = _generate(qwen3_dir, "cuda")
    assert result.exit_code == 2 and "torch sees no GPU" in result.output
