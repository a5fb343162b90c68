"""`handoff train` under torchrun (2 gloo processes) against the same run in one process.

Two steps of examples/cpu-tiny.yaml with data parallel 2 (TP 1) and with one TP = 2 engine
(DP 1) must log the metrics of the one-process run: the same samples (seeds per global
prompt), the same rewards averaged over ranks, and the same FSDP2 update over all ranks.
Step 2 samples from weights the sync pushed into every rank's engine (shards under TP,
checksum-verified), so it checks the sync too.

The model is tiny-qwen3 with unit-gain weights plus a constant feature in every embedding
that favours digits and EOS: its answers to the arithmetic prompts are short numbers, so the
rewards vary within groups (0, 0.1 for the format, 1 when right) and the loss and gradient
are not zero. The same comparison runs on two GPUs (NCCL) where a machine has them.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.loop import Run
from handoff.modelzoo import EOS_ID, init_model

KEYS = ("reward_mean", "reward_std", "response_length", "loss", "grad_norm", "kl", "entropy",
        "num_tokens")  # num_tokens: every sample trained once, on one rank
DIGITS = range(ord("0"), ord("9") + 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = init_model("tiny-qwen3", tmp_path_factory.mktemp("multirank-model"), dtype="float32")
    state = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name, value in state.items():
        gain = 0.5 if "embed" in name else 2.0
        state[name] = (torch.randn(value.shape, generator=gen) * gain / value.shape[1] ** 0.5
                       if value.dim() == 2 else 1 + 0.1 * torch.randn(value.shape, generator=gen))
    embed = state["model.embed_tokens.weight"]
    embed[:, 0] = 20.0   # dominates the final norm's output: a constant logit feature
    embed[list(DIGITS), 0] += 4.0
    embed[EOS_ID, 0] += 4.5
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def overrides(model_dir, out_dir, *extra) -> list[str]:
    return [f"model.path={model_dir}", f"run.out_dir={out_dir}", "run.steps=2", *extra]


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-rank")
    Run(load_config("examples/cpu-tiny.yaml", overrides(model_dir, out))).run()
    rows = metrics(out)
    assert rows[0]["reward_std"] > 0 and rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 0
    return rows


def run(cmd: list[str], *, fails: bool = False) -> str:
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=180)
    assert (done.returncode != 0) == fails, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def torchrun_train(model_dir, out_dir, *extra, fails: bool = False) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "handoff",
                "train", "examples/cpu-tiny.yaml",
                *overrides(model_dir, out_dir, "parallel.gpus=2", *extra)], fails=fails)


def assert_same_metrics(rows: list[dict], alone: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in alone] == [1, 2]
    for ours, theirs in zip(rows, alone):
        for key in KEYS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
        assert ours["sync/bytes"] == theirs["sync/bytes"]   # every rank gets every full tensor


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_two_rank_train_logs_the_one_rank_metrics(model_dir, one_rank, tmp_path, tp):
    said = torchrun_train(model_dir, tmp_path, f"parallel.tp={tp}")
    assert said.count("step   2 ") == 1   # rank 0 prints, rank 1 is quiet
    # the fixed pool's note offers the elastic pool only where it runs (one engine a card)
    assert "generation does not start under them" in said
    assert ("rollout.kv_pool=elastic streams them" in said) == (tp == 1)
    assert_same_metrics(metrics(tmp_path), one_rank)
    assert_sync_bytes_as_planned(tmp_path)


def assert_sync_bytes_as_planned(out_dir) -> None:
    """The sync's measured bytes are what each rank's engine keeps, as the plan counts them
    (under TP its shard; the norms it keeps whole are the 1% the plan splits)."""
    summary = json.loads((out_dir / "summary.json").read_text())
    planned = summary["planned"]["engine_weights_sync"]["bytes"]
    assert summary["measured"]["engine_weights_sync"]["bytes"] == pytest.approx(planned, rel=0.01)


@pytest.mark.slow
def test_an_error_every_rank_has_is_said_once(model_dir, tmp_path):
    said = torchrun_train(model_dir, tmp_path, "parallel.gpus=4", fails=True)
    assert said.count("parallel.gpus=4 but 2 process(es) were started") == 1, said[-4000:]


RANK_ONE_FAILS = """import os

def fails_on_rank_1(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ["RANK"] == "1":
        raise ValueError("no grader here")
    return 0.0
"""


@pytest.mark.slow
def test_a_reward_that_fails_on_one_rank_is_said_by_that_rank_naming_it(model_dir, tmp_path):
    (tmp_path / "rank_reward.py").write_text(RANK_ONE_FAILS)
    said = torchrun_train(model_dir, tmp_path / "run",
                          f"reward.functions=[{tmp_path / 'rank_reward.py'}:fails_on_rank_1]",
                          fails=True)
    assert said.count("reward fails_on_rank_1 raised ValueError on rank 1, sample 0 of its "
                      "batch: no grader here") == 1, said[-4000:]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("tp", [1, 2])
def test_two_gpu_train_logs_the_one_gpu_metrics(model_dir, tmp_path, tp):
    """NCCL for the FSDP2 mesh and the TP engine; the model stays float32, so exact-ish."""
    run([sys.executable, "-m", "handoff", "train", "examples/cpu-tiny.yaml",
         *overrides(model_dir, tmp_path / "one", "run.device=cuda")])
    torchrun_train(model_dir, tmp_path / "two", f"parallel.tp={tp}", "run.device=cuda")
    assert_same_metrics(metrics(tmp_path / "two"), metrics(tmp_path / "one"))


def test_parallel_gpus_must_match_the_processes(model_dir, tmp_path):
    cfg = load_config("examples/cpu-tiny.yaml", overrides(model_dir, tmp_path, "parallel.gpus=2"))
    with pytest.raises(HandoffError, match=r"parallel.gpus=2 but 1 process.*nproc-per-node 2"):
        Run(cfg)
