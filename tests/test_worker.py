"""The hybrid worker and the loop on CPU: switch order, sync exactness, metrics files."""

import json

import pytest
import torch
from safetensors.torch import save_file

from handoff.config import load_config
from handoff.loop import Run
from handoff.modelzoo import init_model
from handoff.plan.ledger import SWITCH_ACTIONS
from handoff.rollout.engine import Engine
from handoff.rollout.sampling import SamplingParams
from handoff.switch.worker import PROBES_TO_ROLLOUT, PROBES_TO_TRAIN

PROMPTS = [[256, 51, 43, 52, 61], [256, 49, 55, 43, 50, 53, 61], [256, 72, 105]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tiny-qwen3 with unit-gain weights, so greedy outputs depend on every weight."""
    out = init_model("tiny-qwen3", tmp_path_factory.mktemp("worker-model"), dtype="float32")
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    state = {k: (torch.randn(v.shape, generator=gen) / v.shape[-1] ** 0.5 if v.dim() == 2
                 else 1 + 0.1 * torch.randn(v.shape, generator=gen)) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def tiny_cfg(model_dir, out_dir, *extra):
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model_dir}",
                                                   f"run.out_dir={out_dir}", *extra])


def greedy(engine, prompts=PROMPTS, n_tokens=6):
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n_tokens,
                                                   ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def fresh_engine_from_actor(trainer, model_dir, tmp_path):
    """A new engine built from a checkpoint of the actor's current full weights."""
    ckpt = tmp_path / "from-actor"
    ckpt.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (ckpt / f.name).write_bytes(f.read_bytes())
    actor = trainer.worker.actor
    actor.to("device", params=True).wait()
    state = {k: v.clone() for k, v in actor.full_params(torch.float32)}
    actor.to("host", params=True).wait()
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return Engine(str(ckpt), trainer.cfg.rollout, device="cpu", dtype=torch.float32)


def test_one_step_runs_the_switch_order(model_dir, tmp_path):
    trainer = Run(tiny_cfg(model_dir, tmp_path, "run.steps=1"))
    trainer.run()
    names = [p["name"] for p in trainer.worker.meter.timeline if p.get("step") == 0]
    assert names == list(PROBES_TO_TRAIN + PROBES_TO_ROLLOUT)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("step", "reward_mean", "timing_s/gen", "timing_s/step"):
        assert key in row
    for action in SWITCH_ACTIONS:
        assert f"switch/{action}/seconds" in row and f"switch/{action}/bytes" in row
    # Offloads on: what went down came back up, byte for byte, and equals the actor's parts.
    parts = trainer.worker.actor.memory_parts()
    assert row["switch/params_d2h/bytes"] == row["switch/params_h2d/bytes"] == parts["params"]
    assert row["switch/optimizer_d2h/bytes"] == row["switch/optimizer_h2d/bytes"] == parts["optimizer"]
    # memory.overlap: the ref comes back every step and is dropped, not copied, after its forward.
    assert row["switch/ref_h2d/bytes"] > 0 and row["switch/ref_d2h/bytes"] == 0
    for name in ("summary.md", "summary.json", "memory_timeline.jsonl", "memory_timeline.png"):
        assert (tmp_path / name).is_file()
    summary = json.loads((tmp_path / "summary.json").read_text())
    for action in ("params_d2h", "optimizer_h2d", "engine_weights_sync"):
        assert summary["planned"][action]["bytes"] == summary["measured"][action]["bytes"]
    from typer.testing import CliRunner

    from handoff.cli import app

    shown = CliRunner().invoke(app, ["report", str(tmp_path)], terminal_width=200)
    assert shown.exit_code == 0 and "engine_weights_sync" in shown.output


def length_mod_3(completions, **kwargs):
    """A reward that varies within groups, so every update really moves the weights."""
    return [float(len(c if isinstance(c, str) else c[0]["content"]) % 3) for c in completions]


def test_engine_equals_fresh_engine_after_every_sync(model_dir, tmp_path):
    cfg = tiny_cfg(model_dir, tmp_path, "run.steps=2", "actor.lr=0.05", "actor.kl_coef=0")
    # A reward that varies within groups, so every update really moves the weights.
    trainer = Run(cfg, reward_funcs=[length_mod_3])
    before = greedy(trainer.worker.engine)
    for step in range(2):
        row = trainer.step(step)
        assert row["sync/verified_buckets"] == row["sync/buckets"] > 0
        ours = greedy(trainer.worker.engine)
        assert ours == greedy(fresh_engine_from_actor(trainer, model_dir, tmp_path))
    assert ours != before, "the updates did not change the policy: the test proves nothing"


def test_sleeping_engine_refuses_to_generate(model_dir, tmp_path):
    trainer = Run(tiny_cfg(model_dir, tmp_path))
    trainer.worker.to_train()
    with pytest.raises(Exception, match="wake_up|asleep"):
        greedy(trainer.worker.engine)
    trainer.worker.engine.wake_up(["weights", "kv_cache"])
    with pytest.raises(Exception, match="load_weights"):
        greedy(trainer.worker.engine)


def _train_cmd(model_dir, out_dir, *extra):
    import sys

    return [sys.executable, "-m", "handoff", "train", "examples/cpu-tiny.yaml",
            f"model.path={model_dir}", f"run.out_dir={out_dir}", "run.steps=3",
            "run.save_every=1", "actor.lr=0.02", *extra]


def _rows(out_dir):
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_killed_run_resumes_without_lost_or_repeated_steps(model_dir, tmp_path):
    import os
    import signal
    import subprocess
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    done = subprocess.run(_train_cmd(model_dir, whole), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen(_train_cmd(model_dir, broken), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while len(_rows(broken)) < 1 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid step 2: its checkpoint is never published
    proc.wait()
    assert [r["step"] for r in _rows(broken)] == [1]
    done = subprocess.run(_train_cmd(model_dir, broken, "run.resume=true"), env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, reference = _rows(broken), _rows(whole)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert json.loads((broken / "summary.json").read_text())["steps"] == 3  # the whole run
    # Same seeds per (step, prompt) and the same restored state: the same run.
    for a, b in zip(resumed, reference):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)


def _wake_fails_once(worker, log):
    """The engine's first weights wake finds the card full; later wakes work."""
    from handoff.errors import HandoffError

    real_wake = worker.engine.wake_up

    def wake(tags):
        log.append(("wake", list(tags)))
        if list(tags) == ["weights"] and log.count(("wake", ["weights"])) == 1:
            raise HandoffError("cannot wake 'weights': not enough free memory")
        real_wake(tags)

    worker.engine.wake_up = wake


def _log_optimizer_copy(worker, log, monkeypatch):
    """Log when the optimizer's copy to the host starts and when it is waited on (the whole
    move or one of its transfers)."""
    real_to = worker.actor.to

    def logged(wait):
        def logged_wait():
            log.append("optimizer copy waited")
            return wait()
        return logged_wait

    def to(where, **parts):
        handle = real_to(where, **parts)
        if parts.get("optimizer") and where == "host":
            log.append("optimizer copy started")
            handle.wait = logged(handle.wait)
            for transfer in handle.transfers.values():
                transfer.wait = logged(transfer.wait)
        return handle

    monkeypatch.setattr(worker.actor, "to", to)


def test_weights_wake_retries_after_the_optimizer_copy_when_the_card_is_full(model_dir, tmp_path,
                                                                              monkeypatch):
    from handoff.errors import HandoffError

    worker = Run(tiny_cfg(model_dir, tmp_path)).worker
    worker.begin_step(0)
    worker.to_train()
    worker.actor.to("device", optimizer=True).wait()
    log = []
    _wake_fails_once(worker, log)
    _log_optimizer_copy(worker, log, monkeypatch)
    record = worker.to_rollout()
    first, second = [i for i, e in enumerate(log) if e == ("wake", ["weights"])]
    assert "optimizer copy waited" in log[first:second], log
    assert log[-1] == ("wake", ["kv_cache"])
    assert record.sync.num_tensors > 0 and worker.pool.is_awake("weights")
    # With nothing in flight to wait for, a full card is an error.
    kept = Run(tiny_cfg(model_dir, tmp_path / "kept", "memory.optimizer_offload=false")).worker
    kept.begin_step(0)
    kept.to_train()
    _wake_fails_once(kept, [])
    with pytest.raises(HandoffError, match="not enough free memory"):
        kept.to_rollout()


def test_cache_is_not_emptied_while_the_optimizer_copy_runs(model_dir, tmp_path, monkeypatch):
    """Emptying the cache synchronizes the device, so an empty-cache between starting the
    optimizer D2H and waiting for it would serialise the copy with the weights wake and sync
    (and free none of the optimizer's memory, released at the wait): to_rollout empties
    only after the wait."""
    import handoff.switch.clock as clock_module
    import handoff.switch.worker as worker_module

    trainer = Run(tiny_cfg(model_dir, tmp_path))
    worker = trainer.worker
    worker.begin_step(0)
    worker.to_train()
    worker.actor.to("device", optimizer=True).wait()
    log = []
    real_empty = worker_module.aggressive_empty_cache
    _log_optimizer_copy(worker, log, monkeypatch)
    for module in (clock_module, worker_module):   # the clock's flushes, the activations'
        monkeypatch.setattr(module, "aggressive_empty_cache",
                            lambda **kw: (log.append("empty cache"), real_empty(**kw))[1])
    worker.to_rollout()
    started = log.index("optimizer copy started")
    waited = log.index("optimizer copy waited")
    assert "empty cache" not in log[started:waited], log
    assert "empty cache" in log[waited:]  # before the KV pool is mapped


@pytest.mark.parametrize("extra, expected", [
    ("memory.overlap=false",
     [("actor.params", True, None), ("ref.params", True, None), ("actor.optimizer", False, None)]),
    ("memory.overlap=true",
     [("ref.params", True, None), ("actor.params", False, None), ("actor.optimizer", False, None)]),
    ("memory.optimizer_back_programs=8",
     [("ref.params", True, None), ("actor.params", False, None), ("actor.optimizer", True, 8)])])
def test_the_copies_after_the_engine_sleep_go_by_kernel(model_dir, tmp_path, monkeypatch,
                                                        extra, expected):
    """The copy engines are busy right after the engine's sleep: what is waited for then
    comes back by kernel (the ledger prices those at the kernel's rate): the params and the
    ref in turn; streamed, the ref's only, and the params' on the copy engines under the
    ref's forward (no SMs taken from it); the optimizer, later, on the copy engines, or by a
    kernel of memory.optimizer_back_programs programs."""
    trainer = Run(tiny_cfg(model_dir, tmp_path, "run.steps=1", extra))
    arena = trainer.worker.actor.arena
    onloads, real_onload = [], arena.onload

    def onload(name, *, by_kernel=False, programs=None):
        onloads.append((name, by_kernel, programs))
        return real_onload(name, by_kernel=by_kernel, programs=programs)

    monkeypatch.setattr(arena, "onload", onload)
    trainer.step(0)
    assert onloads == expected
