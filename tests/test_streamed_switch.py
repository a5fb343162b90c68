"""The streamed switch (memory.overlap) on CPU: the order of its copies against today's, the
reference dropped without a copy, the optimizer's wait placed before its step, copies to the
host landing between engine steps, and the exposed / raw seconds of a step.

On CPU every copy is synchronous, so where a test needs a copy that is still running it
wraps the real one in a `LateTransfer` (not done until waited for, or until queried a few
times). For speed the runs skip the start-up measurements (run.rates_file) and keep their
set-up objects out of the switch's gc.collect() calls, as `Run.run` does."""

import gc
import json
import time

import pytest
import torch

from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.loop import Run, step_prompts
from handoff.modelzoo import init_model
from handoff.plan.ledger import SWITCH_ACTIONS

# One step's events with memory.overlap=false: today's order (docs/ARCHITECTURE.md).
SEQUENTIAL = [
    "probe after generate", "probe after engine sleep", "onload actor.params",
    "probe after params onload", "onload ref.params", "forward ref", "offload ref.params",
    "probe after ref forward", "onload actor.optimizer", "forward actor", "optimizer step", "probe after update",
    "offload actor.optimizer", "probe before resume weights", "wake weights",
    "probe after update_weights", "offload actor.params", "probe after params offload",
    "wake kv_cache", "probe after resume kv_cache"]
# memory.overlap with a fixed pool: the ref's copy back queued, not waited for; the ref's
# GEMM shapes launched once its inputs are on the device; the params' and then the
# optimizer's copies queued once its first micro-batch is (of two), under the rest of its
# forward; the ref dropped after it; the copies to the host still land before the KV wake.
OVERLAPPED = [
    "probe after generate", "probe after engine sleep", "onload ref.params",
    "probe after params onload", "warm gemms ref", "forward ref", "onload actor.params",
    "onload actor.optimizer", "forward ref", "drop ref.params", "probe after ref forward",
    "forward actor", "optimizer step", "probe after update",
    "offload actor.optimizer", "probe before resume weights", "wake weights",
    "probe after update_weights", "offload actor.params", "probe after params offload",
    "wake kv_cache", "probe after resume kv_cache"]


RATES = {"d2h_bps": 5e9, "h2d_bps": 5e9, "d2d_bps": 20e9, "map_bps": 40e9, "unmap_bps": 80e9,
         "remap_bytes": 1 << 20, "tensor_host_s": 2e-5, "sync_copy_bps": 1000e9}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = init_model("tiny-qwen3", tmp_path_factory.mktemp("streamed-model"), dtype="float32")
    (out / "rates.json").write_text(json.dumps(RATES))
    return out


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    yield
    gc.unfreeze()


def length_mod_3(completions, **kwargs):
    """A reward that varies within groups, so every update really moves the weights (the
    text's length: chat completions are TRL's message lists)."""
    return [float(len(c if isinstance(c, str) else c[0]["content"]) % 3) for c in completions]


def _run(model_dir, out_dir, *extra, reward_funcs=()) -> Run:
    run = Run(load_config("examples/cpu-tiny.yaml", [
        f"model.path={model_dir}", f"run.out_dir={out_dir}", "run.checkpoint=false",
        f"run.rates_file={model_dir / 'rates.json'}", *extra]), reward_funcs=reward_funcs)
    gc.collect()
    gc.freeze()
    return run


class LateTransfer:
    """A real Transfer that reports itself done only once waited for, or after `queries`
    calls of done(): a copy still running on a copy engine."""

    def __init__(self, transfer, log, *, queries: int | None = None, wait_seconds: float = 0.0):
        self.transfer, self.log = transfer, log
        self.queries, self.wait_seconds = queries, wait_seconds
        self.landed = False

    def done(self) -> bool:
        if self.queries is not None:
            self.queries -= 1
            self.landed = self.landed or self.queries <= 0
        return self.landed

    def wait(self) -> None:
        if not self.landed:
            self.log.append(f"waited {self.transfer.name}")
            time.sleep(self.wait_seconds)
        self.landed = True
        self.transfer.wait()

    def __getattr__(self, name):
        return getattr(self.transfer, name)


def _late(arena, kind: str, name: str, log, made: list | None = None, **late):
    """Make the arena's `kind` copies ("onload" / "offload") of set `name` late ones (each
    appended to `made`)."""
    real = getattr(arena, kind)

    def copy(set_name, *args, **kwargs):
        transfer = real(set_name, *args, **kwargs)
        if set_name != name:
            return transfer
        transfer = LateTransfer(transfer, log, **late)
        if made is not None:
            made.append(transfer)
        return transfer

    setattr(arena, kind, copy)


def _event_log(worker, monkeypatch) -> list[str]:
    """Log the worker's probes, the arena's copies and drops, the forwards, the GEMM warm-ups,
    the optimizer's step, the engine's wakes and KV growth (consecutive repeats kept once by
    `_compact`)."""
    import handoff.trainer.actor as actor_module
    import handoff.trainer.model as model_module

    log: list[str] = []
    arena = worker.actor.arena

    def logging(fn, text):
        def logged(*args, **kwargs):
            log.append(text(*args))
            return fn(*args, **kwargs)
        return logged

    for kind in ("offload", "onload", "drop"):
        monkeypatch.setattr(arena, kind, logging(getattr(arena, kind),
                                                 lambda name, *_, kind=kind: f"{kind} {name}"))
    monkeypatch.setattr(worker, "probe", logging(worker.probe, lambda name: f"probe {name}"))
    monkeypatch.setattr(worker.engine, "wake_up",
                        logging(worker.engine.wake_up, lambda tags: f"wake {'+'.join(tags)}"))
    monkeypatch.setattr(worker.engine, "grow_kv", logging(worker.engine.grow_kv, lambda: "grow kv"))
    for name in ("actor", "ref"):
        model = getattr(worker, name)
        if model is not None:
            monkeypatch.setattr(model, "warm_gemms", logging(
                model.warm_gemms, lambda *_, name=name: f"warm gemms {name}"))
    monkeypatch.setattr(worker.actor.optimizer, "step",
                        logging(worker.actor.optimizer.step, lambda *a: "optimizer step"))
    def whose(module, *_):
        return "forward ref" if worker.ref and module is worker.ref.module else "forward actor"

    for module in (actor_module, model_module):
        monkeypatch.setattr(module, "token_forward", logging(module.token_forward, whose))
    return log


def _compact(log: list[str]) -> list[str]:
    """Micro-batches repeat a forward: one entry per run of the same event."""
    return [e for i, e in enumerate(log) if i == 0 or e != log[i - 1]]


@pytest.mark.parametrize("overlap, expected", [("false", SEQUENTIAL), ("true", OVERLAPPED)])
def test_the_switch_order_with_overlap_off_and_on(model_dir, tmp_path, monkeypatch, overlap,
                                                  expected):
    trainer = _run(model_dir, tmp_path, f"memory.overlap={overlap}")
    log = _event_log(trainer.worker, monkeypatch)
    row = trainer.step(0)
    assert _compact(log) == expected
    ref_bytes = trainer.worker.ref.memory_parts()["params"]
    assert row["switch/ref_h2d/bytes"] == ref_bytes
    assert row["switch/ref_d2h/bytes"] == (0 if overlap == "true" else ref_bytes)
    parts = trainer.worker.actor.memory_parts()
    for action, part in (("optimizer_h2d", "optimizer"), ("optimizer_d2h", "optimizer"),
                         ("params_h2d", "params"), ("params_d2h", "params")):
        assert row[f"switch/{action}/bytes"] == parts[part]


@pytest.mark.parametrize("warm, offload", [("true", "true"), ("false", "true"),
                                           ("true", "false")])
def test_the_gemm_shapes_are_launched_before_the_copies_back(model_dir, tmp_path, monkeypatch,
                                                             warm, offload):
    import handoff.trainer.gemm_warmup as gemm_warmup

    monkeypatch.setattr(gemm_warmup, "_launched", set())   # a fresh process
    trainer = _run(model_dir, tmp_path, f"memory.warm_gemms={warm}",
                   f"memory.param_offload={offload}", f"memory.optimizer_offload={offload}")
    log = _event_log(trainer.worker, monkeypatch)
    rows = [trainer.step(step) for step in range(2)]
    if warm == "false":
        assert not any(e.startswith("warm gemms") for e in log)
        assert [r["switch/gemms_warmed"] for r in rows] == [0, 0]
        return
    if offload == "false":   # no copy back to queue beside the forwards: nothing to warm for
        assert not any(e.startswith("warm gemms") for e in log)
        assert rows[0]["switch/gemms_warmed"] == 0
        return
    # Once a step, by the ref's forward (the first with copies due), before they are queued.
    assert [e for e in log if e.startswith("warm gemms")] == ["warm gemms ref"] * 2
    first = log.index("warm gemms ref")
    assert first < log.index("forward ref") < log.index("onload actor.params")
    assert rows[0]["switch/gemms_warmed"] > 0
    assert rows[0]["switch/gemms_warmed"] + rows[1]["switch/gemms_warmed"] == len(
        gemm_warmup._launched)


def test_queueing_the_copies_back_is_exposed_not_the_forwards_work(model_dir, tmp_path,
                                                                    fixed_compute_gap):
    # On CUDA queueing them allocates their storages, which waits for the driver to clear
    # memory the engine just freed, while the compute stream sits idle: the clock reads that
    # idle time (dist.ComputeGap) once the stream drains and counts it as the switch's
    # queueing. A gap of a fixed 0.25 s stands in for it.
    trainer = _run(model_dir, tmp_path, "run.steps=2", "memory.warm_gemms=false")
    for step in range(2):
        row = trainer.step(step)   # one pass queues the copies back: one gap a step
        assert row["switch/queue_s"] == 0.25
        assert row["switch/exposed_s"] >= 0.25   # queueing is exposed time
    off = _run(model_dir, tmp_path / "off", "memory.overlap=false")
    assert off.step(0)["switch/queue_s"] == 0.0   # nothing is queued beside a pass


def test_overlap_changes_no_number_of_the_training(model_dir, tmp_path):
    rows = {}
    for overlap in ("false", "true"):
        trainer = _run(model_dir, tmp_path / overlap, f"memory.overlap={overlap}",
                       "actor.lr=0.05", reward_funcs=[length_mod_3])
        rows[overlap] = [trainer.step(step) for step in range(2)]
    for off, on in zip(rows["false"], rows["true"]):
        for key in ("reward_mean", "loss", "pg_loss", "kl", "grad_norm", "entropy"):
            assert off[key] == on[key], key
    assert rows["true"][0]["loss"] != rows["true"][1]["loss"]


def test_the_ref_comes_back_from_its_first_host_copy_every_step(model_dir, tmp_path):
    trainer = _run(model_dir, tmp_path, "actor.lr=0.05", reward_funcs=[length_mod_3])
    worker = trainer.worker
    problems, ids, indices, params = step_prompts(trainer.cfg, trainer.task, trainer.tokenizer, 0)
    batch = trainer._score(0, problems, ids, indices, worker.generate(ids, params).outputs).batch
    seen = []
    for step in range(2):
        worker.begin_step(step)
        worker.to_train()
        logprobs, record = worker.log_probs(batch)
        assert record.actions["ref_d2h"].bytes == 0 < record.actions["ref_h2d"].bytes
        assert all(t.untyped_storage().nbytes() == 0 for t in worker.ref.part_tensors("params"))
        old, _ = worker.actor.log_probs(batch, with_entropy=False)
        seen.append((logprobs["ref"], old))
        batch.ref_logprobs = logprobs["ref"]
        worker.update(batch)
        worker.to_rollout()
    (ref_1, actor_1), (ref_2, actor_2) = seen
    assert torch.equal(ref_1, ref_2)
    assert not torch.equal(actor_1, actor_2), "the actor did not move: the test proves nothing"


@pytest.mark.parametrize("overlap, pool, kl", [("false", "fixed", 0.001),
                                               ("true", "fixed", 0.001),
                                               ("true", "elastic", 0.001),
                                               ("true", "fixed", 0.0), ("true", "elastic", 0.0)])
def test_where_the_optimizer_copy_is_waited_for(model_dir, tmp_path, monkeypatch, overlap,
                                                pool, kl):
    # Queued under the ref's forward, what is left of it is waited for before the update's
    # inputs upload (they would queue behind it). With no ref it runs beside the update's
    # forwards and backwards and is waited for before the optimizer step (elastic: by the
    # flush after the last backward, which waits for every stream).
    trainer = _run(model_dir, tmp_path, f"memory.overlap={overlap}", f"rollout.kv_pool={pool}",
                   f"actor.kl_coef={kl}")
    worker = trainer.worker
    log = _event_log(worker, monkeypatch)
    _late(worker.actor.arena, "onload", "actor.optimizer", log, wait_seconds=0.3)
    row = trainer.step(0)
    events = _compact([e for e in log if e.startswith(("forward actor", "waited",
                                                       "optimizer step"))])
    if overlap == "true" and kl == 0:   # the forwards and backwards ran while the copy did
        assert events == ["forward actor", "waited actor.optimizer", "optimizer step"]
    else:
        assert events == ["waited actor.optimizer", "forward actor", "optimizer step"]
    if overlap == "true":
        assert worker.actor.copy_wait_seconds >= 0.3   # a wait inside the update...
    else:
        assert worker.actor.copy_wait_seconds < 0.3
    # ...is exposed, not compute, wherever it is (the rest of a tiny step's switch: ~10 ms).
    assert row["switch/exposed_s"] >= 0.3


class _CardHoldingTheActor:
    """A simulated card (memory.elastic.SimulatedDevice's fields) whose other owner is the
    actor: its params' and optimizer's storages on the device, and as on CUDA the storages
    of a copy to the host until it lands (on CPU they are freed when it starts), so the KV
    pool maps less while they are there."""

    granule = 4096

    def __init__(self, actor, capacity: int):
        self.actor, self.capacity = actor, capacity
        self.copies: list[LateTransfer] = []   # the copies to the host, landed or not

    @property
    def others(self) -> int:
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                    for part in ("params", "optimizer") for t in self.actor.part_tensors(part)}
        return sum(storages.values()) + sum(c.bytes for c in self.copies if not c.landed)


@pytest.mark.parametrize("wake_blocks", [160, 24])
def test_copies_to_the_host_land_between_engine_steps_and_grow_the_pool(
        model_dir, tmp_path, monkeypatch, wake_blocks):
    # The card has room for the actor's state and `wake_blocks` of the pool's 256: the wake
    # maps those beside the copies still running. 160 hold the step: generation never waits
    # for a block, so the pool is left as it is (growing costs a device sync and the map).
    # 24 hold one sequence of max_model_len, not the step's 16: the pool is short, and grows
    # into the optimizer's memory once it has landed, before the params' copy starts.
    trainer = _run(model_dir, tmp_path, "rollout.kv_pool=elastic", "rollout.num_blocks=256",
                   "memory.wake_margin_mb=0")
    worker = trainer.worker
    arena = worker.engine.kv_arena
    actor_bytes = sum(worker.actor.memory_parts()[p] for p in ("params", "optimizer"))
    card = _CardHoldingTheActor(worker.actor,
                                actor_bytes + wake_blocks * arena.capacity_bytes // 256)
    arena._backend.sim = card
    log = _event_log(worker, monkeypatch)
    _late(worker.actor.arena, "offload", "actor.optimizer", log, card.copies, queries=3)
    _late(worker.actor.arena, "offload", "actor.params", log, card.copies, queries=1)
    runner = worker.engine.runner
    monkeypatch.setattr(runner, "launch", lambda seqs, is_prefill, _launch=runner.launch, **kw: (
        log.append("launch prefill" if is_prefill else "launch decode"),
        _launch(seqs, is_prefill, **kw))[1])
    first = trainer.step(0)
    # The KV pool woke with both copies queued, not started: none is in this step's record,
    # and it mapped what the card had beside the actor's state.
    to_rollout = log[log.index("probe before resume weights"):]
    assert to_rollout[-3:] == ["probe after params offload", "wake kv_cache",
                               "probe after resume kv_cache"]
    assert not any(e.startswith("offload actor.") for e in to_rollout)
    assert first["switch/optimizer_d2h/bytes"] == first["switch/params_d2h/bytes"] == 0
    at_wake = worker.engine.kv_mapped_bytes
    assert at_wake == worker.meter.last["regions"]["kv_cache"]
    assert 0 < at_wake <= wake_blocks * arena.capacity_bytes // 256 < arena.capacity_bytes
    assert worker.engine.blocks.usable == worker.engine._mapped_blocks()
    log.clear()
    second = trainer.step(1)
    # Generation: the optimizer's copy starts once a decode step is launched (the prefills'
    # new GEMM shapes are launched before it), lands at the third look (never waited for),
    # the params' starts then and lands at the next engine step.
    generation = log[:log.index("probe after generate") + 1]
    assert generation.index("launch decode") < generation.index("offload actor.optimizer")
    assert generation[0] == "launch prefill"
    generation = [e for e in generation if not e.startswith("launch ")]
    grown = [p for p in worker.meter.timeline if p["name"] == "kv pool grown"]
    if wake_blocks == 24:
        assert generation[:4] == ["offload actor.optimizer", "grow kv", "probe kv pool grown",
                                  "offload actor.params"]
        # Mapped at the wake, grown during generation: the timeline shows both.
        assert len(grown) == 1 and grown[0]["regions"]["kv_cache"] > at_wake
        # The growth is the wake's second map: the step's kv_cache_wake holds both.
        assert second["switch/kv_cache_wake/bytes"] == (grown[0]["regions"]["kv_cache"]
                                                        - at_wake + worker.engine.kv_mapped_bytes)
    else:
        assert generation == ["offload actor.optimizer", "offload actor.params",
                              "probe after generate"] and not grown
        assert second["switch/kv_cache_wake/bytes"] == worker.engine.kv_mapped_bytes
    assert "waited actor.optimizer" not in log
    parts = worker.actor.memory_parts()
    assert second["switch/optimizer_d2h/bytes"] == parts["optimizer"]
    assert second["switch/params_d2h/bytes"] == parts["params"]
    assert second["switch/optimizer_d2h/seconds"] > 0
    # The last step's copies land when the run ends (a checkpoint or a resume settles too).
    assert worker.copies_pending
    worker.settle()
    assert not worker.copies_pending
    assert worker.copies.take_landed().actions["params_d2h"].bytes == parts["params"]
    assert all(t.untyped_storage().nbytes() == 0 for t in worker.actor.part_tensors("params"))


def test_a_run_settles_its_last_copies(model_dir, tmp_path):
    trainer = _run(model_dir, tmp_path, "run.steps=2", "rollout.kv_pool=elastic")
    trainer.run()
    assert not trainer.worker.copies_pending
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["switch/optimizer_d2h/bytes"] == 0 < rows[1]["switch/optimizer_d2h/bytes"]


def test_a_fixed_pool_says_once_why_it_waits(model_dir, tmp_path, capsys):
    trainer = _run(model_dir, tmp_path, "run.steps=2")
    trainer.run()
    said = [line for line in capsys.readouterr().err.splitlines() if "memory.overlap" in line]
    assert len(said) == 1 and "rollout.kv_pool=elastic" in said[0]
    quiet = _run(model_dir, tmp_path / "off", "memory.overlap=false")
    quiet.step(0)
    assert "memory.overlap" not in capsys.readouterr().err


def test_a_card_too_full_for_the_early_copies_back_falls_back_and_says_so(
        model_dir, tmp_path, monkeypatch, capsys):
    import handoff.switch.copies as copies_module

    trainer = _run(model_dir, tmp_path)
    log = _event_log(trainer.worker, monkeypatch)
    monkeypatch.setattr(copies_module, "device_free_bytes", lambda device: 1 << 20)
    for step in range(2):
        trainer.step(step)
    onloads = [e for e in _compact(log) if e.startswith(("onload", "forward", "drop"))]
    # No room beside the ref's forward: the params and the optimizer wait for the update,
    # then come back in turn: the params before it, the optimizer once its first micro-batch
    # is queued (of two), waited for there (the sequential order); the ref kept streamed (its
    # forward waits for it either way).
    assert onloads[:7] == ["onload ref.params", "forward ref", "drop ref.params",
                           "onload actor.params", "forward actor", "onload actor.optimizer",
                           "forward actor"]
    said = [line for line in capsys.readouterr().err.splitlines()
            if "come back before the compute that needs them" in line]
    assert len(said) == 2 and "params need" in said[0] and "optimizer need" in said[1]


def test_a_kv_wake_that_does_not_fit_beside_the_copies_waits_for_them(model_dir, tmp_path,
                                                                      monkeypatch, capsys):
    trainer = _run(model_dir, tmp_path, "rollout.kv_pool=elastic")
    worker = trainer.worker
    real_wake = worker.engine.wake_up

    def wake(tags):
        if tags == ["kv_cache"] and worker.copies_pending:
            raise HandoffError("cannot wake 'kv_cache': not enough free memory")
        real_wake(tags)

    monkeypatch.setattr(worker.engine, "wake_up", wake)
    row = trainer.step(0)
    parts = worker.actor.memory_parts()
    assert row["switch/optimizer_d2h/bytes"] == parts["optimizer"]   # landed in this step
    assert row["switch/params_d2h/bytes"] == parts["params"]
    assert worker.pool.is_awake("kv_cache")
    assert "they are waited for first" in capsys.readouterr().err


def test_exposed_and_raw_seconds_in_the_metrics_and_the_summary(model_dir, tmp_path):
    trainer = _run(model_dir, tmp_path, "run.steps=2")
    summary = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        raw = sum(row[f"switch/{a}/seconds"] for a in SWITCH_ACTIONS)
        assert row["switch/raw_s"] == pytest.approx(raw)
        # CPU copies are synchronous: every action is on the host's path, outside the work.
        assert row["switch/raw_s"] <= row["switch/exposed_s"] < row["timing_s/step"]
        assert row["train_tokens"] > 0
    assert summary["exposed_seconds"] == pytest.approx(rows[1]["switch/exposed_s"])
    assert summary["raw_seconds"] == pytest.approx(rows[1]["switch/raw_s"])
    planned = summary["planned"]
    assert planned["ref_d2h"]["bytes"] == 0 == planned["ref_d2h"]["exposed_seconds"]
    # The optimizer's copy back hides behind the trainer's modelled compute.
    assert planned["optimizer_h2d"]["exposed_seconds"] < planned["optimizer_h2d"]["seconds"]
    # ... and host work the ledger does not price, measured, is exposed by its nature: the
    # step's own (prompts, scoring), the switch's cache flushes and its queueing of the
    # copies back.
    assert 0 < summary["host_seconds"] == pytest.approx(rows[1]["timing_s/host"])
    assert 0 < summary["flush_seconds"] == pytest.approx(rows[1]["switch/flush_s"])
    assert 0 < summary["queue_seconds"] == pytest.approx(rows[1]["switch/queue_s"])
    assert rows[1]["switch/flush_s"] < rows[1]["switch/exposed_s"]
    assert summary["planned_exposed_seconds"] == pytest.approx(
        sum(p["exposed_seconds"] for p in planned.values()) + summary["host_seconds"]
        + summary["flush_seconds"] + summary["queue_seconds"])
    md = (tmp_path / "summary.md").read_text()
    assert "| switch, exposed |" in md and "planned exposed s" in md
