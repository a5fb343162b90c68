"""LoRA through the loop on a CUDA card (the device): the trainer's base as views of the
engine's weights inside its memory region through forwards and backwards, the decode graphs
captured with the adapter slots and fed by the in-place sync, and a base of the trainer's own
backed up and restored by a level-1 sleep. What the CPU tests check (test_loop_lora.py) holds
here too: the sync moves the adapters only and the shared base is never written."""

import hashlib

import pytest
import torch

from handoff.modelzoo import init_model
from test_loop_lora import _rows, _run

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("lora-cuda-model"), dtype="bfloat16")


def _engine_checksum(engine) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(engine.model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("share", [True, False])
def test_a_lora_run_on_the_card_syncs_the_adapters_and_keeps_the_base(bf16_model, tmp_path,
                                                                      share):
    run = _run(bf16_model, tmp_path, "run.steps=3", "run.checkpoint=false", "run.device=cuda",
               "model.dtype=bfloat16", "rollout.cuda_graphs=true", "actor.kl_coef=0.01",
               f"actor.lora.share_base={str(share).lower()}")
    before = _engine_checksum(run.worker.engine)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in
                        run.worker.actor.module.named_parameters() if "lora_" in n)
    run.run()
    rows = _rows(tmp_path)
    assert len(rows) == 3
    for row in rows:
        assert row["sync/bytes"] == adapter_bytes
        assert all(torch.isfinite(torch.tensor(row[k])) for k in ("loss", "grad_norm", "kl"))
    assert rows[-1]["kl"] > 0   # the engine sampled with adapters that moved off the base
    assert _engine_checksum(run.worker.engine) == before   # the base, never written
