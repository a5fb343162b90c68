"""Tensor-parallel engine on CPU: two gloo processes under torchrun against one process.

`torchrun --nproc-per-node 2 -m handoff generate --tp 2` must print what `--tp 1` prints
(greedy, and seeded sampling on a model whose one KV head is replicated on both ranks with
an untied head); a TP = 2 engine must sleep and wake its regions on every rank, take a
verified weight sync on each, and refuse (on every rank, not hang) a call that differs
between ranks. The same engine job runs on two GPUs (NCCL) where a machine has them.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tp_engine_job as job
from handoff.config import RolloutConfig
from handoff.errors import HandoffError
from handoff.rollout.cli_generate import generate_samples
from handoff.rollout.engine import Engine

HERE = Path(__file__).parent
PROMPTS = ["2+2=", "Hello there, how", "x"]


def torchrun(args: list[str], *, timeout: float = 120) -> str:
    """Run `args` (a module or a script and its arguments) in 2 processes; returns stdout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def cli_generate(model: Path, *flags: str) -> list[dict]:
    args = ["-m", "handoff", "generate", "--model", str(model), "--tp", "2", "--json", *flags]
    for p in PROMPTS:
        args += ["--prompt", p]
    return json.loads(torchrun(args))  # rank 1 prints nothing, or this would not parse


def mqa_untied_checkpoint(src: Path, out: Path) -> Path:
    """tiny-qwen3 with ONE KV head (replicated over 2 TP ranks) and its own lm_head."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(num_key_value_heads=1, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = state[name][:config["head_dim"]].clone()
    hidden = config["hidden_size"]
    state["lm_head.weight"] = torch.randn(config["vocab_size"], hidden, generator=gen) * 2 / hidden**0.5
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_generate_tp2_prints_what_tp1_prints(qwen3_dir):
    ours = cli_generate(qwen3_dir, "--max-tokens", "12", "--temperature", "0")
    alone = generate_samples(str(qwen3_dir), PROMPTS, max_tokens=12, temperature=0.0)
    assert [s["token_ids"] for s in ours] == [s["token_ids"] for s in alone]
    assert len({tuple(s["token_ids"]) for s in ours}) == len(PROMPTS)  # lively: all differ
    for a, b in zip(ours, alone):
        assert a["text"] == b["text"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def test_generate_tp2_replicated_kv_head_untied_head_sampled(qwen3_dir, tmp_path, ref):
    model = mqa_untied_checkpoint(qwen3_dir, tmp_path / "mqa")
    ours = cli_generate(model, "--max-tokens", "10", "--temperature", "1", "-n", "2",
                        "--seed", "3")
    alone = generate_samples(str(model), PROMPTS, max_tokens=10, temperature=1.0, n=2, seed=3)
    assert [s["token_ids"] for s in ours] == [s["token_ids"] for s in alone]
    greedy = generate_samples(str(model), PROMPTS[:1], max_tokens=8, temperature=0.0,
                              chat=False)   # raw bytes, as ref.greedy gets them
    prompt = list(PROMPTS[0].encode())
    assert greedy[0]["token_ids"] == ref.greedy(model, prompt, 8)  # the MQA model is right


def run_engine_job(ckpt: Path, out: Path, device: str) -> list[dict]:
    torchrun([str(HERE / "tp_engine_job.py"), str(ckpt), str(out), device])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def engine_job(qwen3_dir, tmp_path_factory):
    return run_engine_job(qwen3_dir, tmp_path_factory.mktemp("tp-job"), "cpu")


def check_ranks_match_one_process(ranks: list[dict], ckpt: Path, device: str) -> None:
    alone = Engine(str(ckpt), RolloutConfig(**job.CFG), device=device, dtype=torch.float32)
    greedy = job.tokens(alone.generate(job.PROMPTS, job.GREEDY))
    sampled = job.tokens(alone.generate(job.PROMPTS, job.SAMPLED))
    for rank, r in enumerate(ranks):
        assert (r["stats"]["tp_rank"], r["stats"]["tp_size"]) == (rank, 2)
        assert r["greedy"] == r["greedy_after_sync"] == greedy
        assert r["sampled"] == sampled
    assert ranks[0]["unseeded"] == ranks[1]["unseeded"]  # one shared seed stream
    # Each rank's pool holds its own KV head only: half the bytes per block of one process.
    assert ranks[0]["kv_shape"][-2] == 1 and alone.runner.kv_storage.shape[-2] == 2
    assert ranks[0]["stats"]["kv_block_bytes"] * 2 == alone.stats()["kv_block_bytes"]


def check_every_rank_sleeps_wakes_and_verifies(ranks: list[dict]) -> None:
    for r in ranks:
        s = r["states"]
        assert set(s["awake"]["awake"].values()) == {True}
        assert set(s["asleep"]["awake"].values()) == {False}
        assert s["weights_awake"]["awake"] == {"weights": True, "kv_cache": False}
        assert s["awake_again"]["awake"] == s["awake"]["awake"]
        held = sum(s["awake"]["region_bytes"].values())
        if s["awake"]["device_free"] is None:   # CPU: the storages themselves shrink
            assert s["awake"]["kv_bytes"] > 0 and s["awake"]["weight_bytes"] > 0
            assert s["asleep"]["kv_bytes"] == s["asleep"]["weight_bytes"] == 0
            assert s["weights_awake"]["weight_bytes"] == s["awake"]["weight_bytes"]
            assert s["weights_awake"]["kv_bytes"] == 0
            assert s["awake_again"] == s["awake"]
        else:                                   # CUDA: the pages go back to the driver
            assert s["asleep"]["device_free"] - s["awake"]["device_free"] >= 0.9 * held
            assert s["awake_again"]["device_free"] <= s["asleep"]["device_free"] - 0.9 * held
        assert "asleep" in r["asleep_error"]
        assert "checksum mismatch" in r["unsliced_verify_error"]
        assert r["sync"]["verified"] == r["sync"]["buckets"] > 1
        assert "different generate requests" in r["mismatch_error"]


def test_tp_engine_ranks_match_one_process(engine_job, qwen3_dir):
    check_ranks_match_one_process(engine_job, qwen3_dir, "cpu")


def test_every_tp_rank_sleeps_wakes_and_verifies_its_shard(engine_job):
    check_every_rank_sleeps_wakes_and_verifies(engine_job)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp_engine_on_two_gpus(qwen3_dir, tmp_path):
    """NCCL, one GPU per rank, float32 (eager decode) so TP 2 and TP 1 agree exactly."""
    ranks = run_engine_job(qwen3_dir, tmp_path, "cuda")
    check_ranks_match_one_process(ranks, qwen3_dir, "cuda")
    check_every_rank_sleeps_wakes_and_verifies(ranks)


def test_tp_needs_as_many_processes():
    with pytest.raises(HandoffError, match="torchrun --nproc-per-node 2"):
        generate_samples("unused", ["x"], max_tokens=1, temperature=0.0, tp=2)
