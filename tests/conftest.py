"""Fixtures several test files share."""

import shutil
import signal

import pytest

from handoff.modelzoo import init_model


@pytest.fixture(autouse=True)
def sigint_handler_restored():
    """`handoff train` ignores a second Ctrl-C once interrupted: a test that goes through it
    in this process gets Ctrl-C back afterwards."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not handler:
        signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="session")
def good(tmp_path_factory):
    """A tiny random Qwen3 directory, made once; tests read it, never change it."""
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("good-model"), dtype="float32")


@pytest.fixture
def model(good, tmp_path):
    """This test's own copy of `good`, free to damage."""
    copy = tmp_path / "model"
    shutil.copytree(good, copy)
    return copy


@pytest.fixture
def fixed_compute_gap(monkeypatch):
    """The switch's clock reads every compute gap as a fixed 0.25 s (once closed): on CUDA
    the stream's idle time while the host queues copies, here a stand-in."""
    import handoff.switch.clock as clock_module

    class Gap:
        def __init__(self, device):
            self.closed = False

        def close(self):
            self.closed = True

        def seconds(self):
            assert self.closed
            return 0.25

    monkeypatch.setattr(clock_module, "ComputeGap", Gap)
    return 0.25


@pytest.fixture(autouse=True)
def reward_folders_of_this_test(monkeypatch):
    """Reward files' folders are remembered per process (two folders with a helper of one
    name are refused): each test starts with none, as a run's process does."""
    from handoff.rewards import loading

    monkeypatch.setattr(loading, "_REWARD_FOLDERS", set())
