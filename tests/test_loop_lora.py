"""`handoff train`'s loop under LoRA on CPU (examples/cpu-tiny.yaml, actor.lora.rank=4): the
switch moves the adapters only (the engine's sleep keeps its weights, the actor's base is
them), the KL reference is the actor with its adapters off, the summary says LoRA, and a
run resumed from a LoRA checkpoint logs what the uninterrupted run logs, bit for bit."""

import json

import pytest

from handoff.config import load_config
from handoff.loop import Run
from handoff.modelzoo import init_model

# What a step computes (not how long it took): equal bit for bit after a resume.
COMPUTED = ("step", "reward_mean", "reward_std", "response_length", "train_tokens", "loss",
            "pg_loss", "kl", "entropy", "grad_norm", "num_tokens", "sync/bytes")
LORA = ("actor.lora.rank=4", "actor.lora.alpha=8", "actor.lr=5e-3")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("lora-loop-model"), dtype="float32")


def token_parity(completion_ids, **kwargs) -> list[float]:
    """A reward that varies within a group of a random model's completions (the arithmetic
    grader gives them all 0, which would leave nothing to learn)."""
    return [float(sum(ids) % 2) for ids in completion_ids]


def _run(model_dir, out_dir, *extra) -> Run:
    return Run(load_config("examples/cpu-tiny.yaml", [
        f"model.path={model_dir}", f"run.out_dir={out_dir}", *LORA, *extra]),
        reward_funcs=[token_parity])


def _rows(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_run_moves_the_adapters_only_and_resumes_bit_identically(model_dir, tmp_path):
    straight = _run(model_dir, tmp_path / "straight", "run.steps=4", "run.save_every=2")
    assert straight.worker.ref is None and straight.worker.order.mode == "lora"
    adapters = straight.worker.actor.part_tensors("params")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters)
    summary = straight.run()
    rows = _rows(tmp_path / "straight")
    assert summary["lora"] == "LoRA rank 4 (alpha 8), the base held once (the engine's weights)"
    for row in rows:
        assert row["sync/bytes"] == adapter_bytes   # the adapters, never the base
        assert row["switch/params_d2h/bytes"] == row["switch/ref_d2h/bytes"] == 0
        assert row["switch/optimizer_d2h/bytes"] == 2 * adapter_bytes   # fp32 Adam moments
    assert rows[0]["kl"] == 0 and rows[-1]["kl"] > 0   # the adapters moved off the base
    assert all(r["grad_norm"] > 0 for r in rows)
    assert "LoRA rank 4" in (tmp_path / "straight" / "summary.md").read_text()
    # the adapters' sync, timed at start, prices the ledger's sync: a tensor at its cost
    done = json.loads((tmp_path / "straight" / "summary.json").read_text())
    tensors = len(adapters)
    assert done["rates"]["adapter_tensor_s"] > 0
    assert done["planned"]["engine_weights_sync"]["seconds"] == pytest.approx(
        max(tensors * done["rates"]["adapter_tensor_s"],
            2 * adapter_bytes / done["rates"]["sync_copy_bps"]))

    _run(model_dir, tmp_path / "cut", "run.steps=2", "run.save_every=2").run()
    resumed = _run(model_dir, tmp_path / "cut", "run.steps=4", "run.save_every=2",
                   "run.resume=true")
    assert resumed.start_step == 2
    resumed.run()
    assert [{k: r.get(k) for k in COMPUTED} for r in _rows(tmp_path / "cut")] == \
        [{k: r.get(k) for k in COMPUTED} for r in rows]


@pytest.mark.parametrize("extra", [("memory.overlap=false",), ("actor.lora.share_base=false",)],
                         ids=["sequential", "own-base"])
def test_lora_in_turn_or_on_its_own_base_runs_its_order(model_dir, tmp_path, extra):
    run = _run(model_dir, tmp_path, "run.steps=2", "run.checkpoint=false", *extra)
    shared = "actor.lora.share_base=false" not in extra
    assert run.worker.order.mode == ("lora" if shared else "streamed")
    actor = run.worker.actor
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in
                        actor.module.named_parameters() if "lora_" in n)
    base_bytes = sum(p.numel() * p.element_size() for n, p in
                     actor.module.named_parameters() if "lora_" not in n)
    run.run()
    rows = _rows(tmp_path)
    for row in rows:
        # Its own base never changes either: the engine's sleep backs it up to the host
        # (level 1), its wake restores it, the sync sends the adapters only.
        assert row["sync/bytes"] == adapter_bytes < base_bytes
        assert (row["switch/params_d2h/bytes"] > 0) == (not shared)
    # the ledger prices a LoRA run as LoRA: the trainer's own base and the adapters move, the
    # engine's base goes to the host and back (measured: its weights region, a few buffers
    # beside the parameters)
    planned = json.loads((tmp_path / "summary.json").read_text())["planned"]
    for action in ("params_d2h", "optimizer_d2h", "engine_sleep", "engine_weights_sync"):
        measured = rows[-1][f"switch/{action}/bytes"]
        assert planned[action]["bytes"] == pytest.approx(measured, rel=0.05), action
        assert (measured > 0) == (not shared or action in ("optimizer_d2h",
                                                          "engine_weights_sync")), action
    assert rows[-1]["kl"] > 0
