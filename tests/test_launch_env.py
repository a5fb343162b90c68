"""Torchrun's variables without torchrun (issue 33): a partial or garbled set is refused in
one line, never taken as a world it is not (a lone WORLD_SIZE=2 trained on half the prompts)."""

import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from handoff import dist
from handoff.cli import app
from handoff.errors import HandoffError, RankError

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
FULL = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500"}


@pytest.fixture
def env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    # A group an earlier test made in this process would answer instead of the environment.
    monkeypatch.setattr(dist.dist, "is_initialized", lambda: False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


def test_a_lone_process_is_a_world_of_one(env):
    assert dist.launch_env() is None and dist.world_rank_size() == (0, 1)
    env(MASTER_ADDR="10.0.0.1", MASTER_PORT="1234")   # a cluster shell's exports alone
    assert dist.launch_env() is None and dist.world_rank_size() == (0, 1)


def test_a_whole_launch_is_taken_as_it_is(env):
    env(**FULL)
    assert dist.launch_env() == (1, 2, 1) and dist.world_rank_size() == (1, 2)
    env(LOCAL_RANK="0")
    assert dist.launch_env() == (1, 2, 0)


@pytest.mark.parametrize("values", [{"WORLD_SIZE": "1"}, {"WORLD_SIZE": " 1"},
                                    {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}])
def test_a_partial_launch_that_says_one_process_is_one(env, values):
    env(**values)
    assert dist.launch_env() is None and dist.world_rank_size() == (0, 1)
    dist.check_world_size(1)


@pytest.mark.slow
def test_train_with_a_lone_world_size_of_one_trains(good, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    done = subprocess.run([sys.executable, "-m", "handoff", "train", "examples/cpu-tiny.yaml",
                           f"model.path={good}", f"run.out_dir={tmp_path}", "run.steps=1"],
                          env={**env, "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("values,match", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not"),
    ({"RANK": "3"}, "RANK=3 is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 is set but RANK, WORLD_SIZE"),
    ({"WORLD_SIZE": "1", "RANK": "1"}, "RANK=1 is set but MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "1", "LOCAL_RANK": "2"}, "WORLD_SIZE=1 is set but RANK, MASTER_ADDR"),
    ({**FULL, "WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a whole number >= 1"),
    ({**FULL, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number >= 1"),
    ({**FULL, "WORLD_SIZE": ""}, "WORLD_SIZE='' is not a whole number >= 1"),
    ({**FULL, "RANK": "2"}, r"RANK='2' is not 0\.\.1"),
    ({**FULL, "RANK": "-1"}, r"RANK='-1' is not 0\.\.1"),
    ({**FULL, "LOCAL_RANK": "5"}, r"LOCAL_RANK='5' is not 0\.\.1"),
    ({**FULL, "LOCAL_RANK": "1.5"}, r"LOCAL_RANK='1.5' is not 0\.\.1"),
])
def test_a_partial_or_garbled_launch_is_refused(env, values, match):
    env(**values)
    for call in (dist.launch_env, dist.world_rank_size, lambda: dist.check_world_size(1)):
        with pytest.raises(HandoffError, match=match + ".*torchrun --nproc-per-node N"):
            call()


def test_local_rank_beyond_the_cards_is_refused(env, monkeypatch):
    env(**{**FULL, "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(HandoffError, match=r"LOCAL_RANK=3 but torch sees 2 GPU\(s\)"):
        dist.resolve_device("cuda")


def test_an_error_every_rank_raises_alike_is_said_by_local_rank_zero(env, monkeypatch):
    alike, own = HandoffError("a config error"), RankError("this rank's card")
    env(**FULL)   # rank 1 of 2, local rank 1, before the ranks meet
    assert not dist.says_error(alike) and dist.says_error(own)
    env(LOCAL_RANK="0")   # the first rank of its node (a node's files are its own)
    assert dist.says_error(alike)
    env(LOCAL_RANK="1")
    monkeypatch.setattr(dist.dist, "is_initialized", lambda: True)   # the group formed
    assert dist.says_error(alike)


def test_a_refused_launch_and_a_lone_process_say_every_error(env):
    assert dist.says_error(HandoffError("alone"))
    env(RANK="1")   # no WORLD_SIZE: the launch itself is refused, in every process
    assert dist.says_error(HandoffError("RANK=1 is set but ..."))


def test_train_and_generate_with_a_stray_world_size_say_one_line_and_write_nothing(env,
                                                                                  tmp_path):
    env(WORLD_SIZE="2")
    runner = CliRunner()
    for args in (["train", "examples/cpu-tiny.yaml", f"run.out_dir={tmp_path / 'run'}"],
                 ["generate", "--model", str(tmp_path), "--prompt", "hi"]):
        res = runner.invoke(app, args, terminal_width=400)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1, res.output
        assert "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not" in lines[0]
    assert not (tmp_path / "run").exists()


def test_torchruns_variables_without_torchrun_say_what_the_start_waits_for(env, monkeypatch,
                                                                           capsys):
    """A full set left in a shell: the rendezvous would wait 30 minutes without a word."""
    joined = []
    monkeypatch.setattr(dist.dist, "init_process_group", lambda *a, **kw: joined.append(kw))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    env(**FULL)
    dist.init_process_group(torch.device("cpu"))
    err = capsys.readouterr().err
    assert joined and err.count("\n") == 1
    assert err.startswith("rank 1 of 2: waiting for the other ranks at 127.0.0.1:29500")
    assert "unset them to run one process" in err
    env(TORCHELASTIC_RUN_ID="abc")   # torchrun's own launch: nothing to say
    dist.init_process_group(torch.device("cpu"))
    assert len(joined) == 2 and not capsys.readouterr().err


def test_a_rank_that_leaves_the_error_to_another_waits_before_it_exits(env, monkeypatch):
    """torchrun stops every rank once one exits: the silent rank of an error every rank has
    waits first, so local rank 0 (met it a moment later) gets to say it; the rank that says
    it does not wait."""
    from handoff import cli

    waited = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)

    @cli.friendly_errors
    def fails():
        raise HandoffError("parallel.gpus=4 but 2 process(es) were started")

    env(**FULL)   # rank 1 of 2, local rank 1, before the ranks meet
    with pytest.raises(SystemExit) as left:
        fails()
    assert left.value.code == 2 and waited == [cli.SILENT_RANK_GRACE_S]
    env(RANK="0", LOCAL_RANK="0")
    with pytest.raises(SystemExit):
        fails()
    assert waited == [cli.SILENT_RANK_GRACE_S]
