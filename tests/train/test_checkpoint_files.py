"""What a resume trusts: no code from a checkpoint, damaged files named in one line, a
checkpoint only loads into the model that wrote it, and a full disk is called a full disk.

A planted payload is a pickle whose __reduce__ creates a marker file: if anything unpickles
it, the marker appears. The first test shows the payload really runs under plain pickle, so
the others prove something.
"""

import collections
import io
import json
import pickle
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch

from handoff.config import ActorConfig, load_config
from handoff.errors import HandoffError
from handoff.modelzoo import init_model
from handoff.train.actor import Actor
from handoff.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from handoff.train.checkpoint import checkpoint_bytes
from handoff.runplan import RunPlan


class Plant:
    """Unpickling this creates `marker`: the stand-in for any code a payload could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("safety-model"), dtype="float32"))


@pytest.fixture(scope="module")
def actor(model):
    return Actor(model, actor=ActorConfig(), dtype="float32")


@pytest.fixture(scope="module")
def saved(actor, tmp_path_factory):
    """A root with one complete checkpoint (step 1), copied by each test that damages it."""
    root = tmp_path_factory.mktemp("saved") / "checkpoints"
    save_checkpoint(root, actor, step=1, extra={"task": {"pos": 4}})
    return root


@pytest.fixture
def root(saved, tmp_path):
    copy = tmp_path / "run" / "checkpoints"
    shutil.copytree(saved, copy)
    return copy


def _file(root: Path, name: str) -> Path:
    step_dir = latest_checkpoint(root)
    if name == "shard":
        return sorted(step_dir.glob("__*.distcp"))[0]
    return root / name if name == "latest" else step_dir / name


def test_the_payload_runs_under_plain_pickle(tmp_path):
    pickle.loads(pickle.dumps(Plant(tmp_path / "ran")))
    assert (tmp_path / "ran").exists()


FILES = (".metadata", "shard", "rng_rank0.json", "meta.json", "latest", "rng_rank0.pt")


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("form", ["pickle", "torch.save"])
def test_a_planted_pickle_in_any_file_a_resume_reads_never_runs(actor, root, tmp_path, name,
                                                                form):
    marker = tmp_path / "ran"
    target = _file(root, name)
    if form == "pickle":
        target.write_bytes(pickle.dumps(Plant(marker)))
    else:
        buffer = io.BytesIO()
        torch.save(Plant(marker), buffer)
        target.write_bytes(buffer.getvalue())
    if name == "rng_rank0.pt":   # the old RNG file: never opened any more
        assert load_checkpoint(root, actor)["step"] == 1
    else:
        with pytest.raises(HandoffError) as e:
            load_checkpoint(root, actor)
        assert "\n" not in str(e.value)
        assert target.name in str(e.value) or name == "latest" and "latest" in str(e.value)
    assert not marker.exists(), "the planted payload ran"


def test_a_planted_metadata_with_its_hash_rewritten_is_still_not_unpickled(actor, root,
                                                                            tmp_path):
    """Someone who can rewrite meta.json too: the allow-list still refuses the payload."""
    import hashlib

    marker = tmp_path / "ran"
    metadata = _file(root, ".metadata")
    metadata.write_bytes(pickle.dumps(Plant(marker)))
    meta_path = _file(root, "meta.json")
    meta = json.loads(meta_path.read_text())
    meta["files"][".metadata"] = hashlib.sha256(metadata.read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(HandoffError, match="not a DCP metadata file handoff accepts.*open is "
                                           "not part of.*nothing in it was run"):
        load_checkpoint(root, actor)
    assert not marker.exists()


@pytest.mark.parametrize("pointer", ["../../elsewhere/step_00000001_abc", "/tmp/step_1_x",
                                     "step_1_x/../../x", "..", ""])
def test_latest_is_never_followed_out_of_its_directory(actor, root, pointer):
    (root / "latest").write_text(pointer)
    with pytest.raises(HandoffError, match="not a step_\\* directory of"):
        load_checkpoint(root, actor)


def test_a_linked_step_directory_out_of_the_root_is_refused(actor, root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(latest_checkpoint(root), outside)
    (root / "step_00000009_link").symlink_to(outside, target_is_directory=True)
    (root / "latest").write_text("step_00000009_link")
    with pytest.raises(HandoffError, match="not a step_\\* directory of"):
        load_checkpoint(root, actor)


@pytest.mark.parametrize("name, words", [
    ("shard", "does not match the sha256 recorded at save"),
    (".metadata", "does not match the sha256 recorded at save"),
    ("rng_rank0.json", "does not match the sha256 recorded at save"),
    ("meta.json", "is not valid JSON"),
])
def test_a_truncated_file_is_one_line_naming_it(actor, root, name, words):
    target = _file(root, name)
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    with pytest.raises(HandoffError) as e:
        load_checkpoint(root, actor)
    assert words in str(e.value) and str(target) in str(e.value)
    assert "\n" not in str(e.value)


def test_a_checkpoint_of_an_older_format_is_refused(actor, root):
    meta_path = _file(root, "meta.json")
    meta = json.loads(meta_path.read_text())
    del meta["format"], meta["files"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(HandoffError, match="older handoff.*cannot be verified"):
        load_checkpoint(root, actor)


def test_a_resume_into_another_architecture_is_refused(root, tmp_path):
    """A Llama with the same tensor shapes would otherwise load the Qwen3 checkpoint's
    subset of names and train silently."""
    llama = Actor(str(init_model("tiny-llama", tmp_path / "llama", dtype="float32")),
                  actor=ActorConfig(), dtype="float32")
    with pytest.raises(HandoffError, match="its architecture is qwen3, this run's is llama"):
        load_checkpoint(root, llama)


def test_a_resume_in_another_dtype_is_refused_and_dcp_errors_are_caught(model, root):
    bf16 = Actor(model, actor=ActorConfig(), dtype="bfloat16")
    with pytest.raises(HandoffError, match="its dtype is float32, this run's is bfloat16"):
        load_checkpoint(root, bf16)
    # With the identity edited to match, DCP itself fails (its CheckpointException derives
    # from BaseException): still the one-line error, not a traceback.
    meta_path = _file(root, "meta.json")
    meta = json.loads(meta_path.read_text())
    meta["model"]["dtype"] = "bfloat16"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(HandoffError, match="does not fit this model"):
        load_checkpoint(root, bf16)


def test_a_full_disk_is_named_and_the_last_checkpoint_stays_intact(actor, root, monkeypatch):
    """A file size limit makes the real writer fail mid-save, as a full disk does."""
    before = latest_checkpoint(root)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 9, 10 ** 9, 4096))
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        with pytest.raises(HandoffError) as e:
            save_checkpoint(root, actor, step=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    text = str(e.value)
    assert "checkpoint step 2 could not be written" in text and "the disk is full" in text
    assert f"one checkpoint needs {checkpoint_bytes(actor) / 1e6:.1f} MB" in text
    assert f"the last checkpoint ({before.name}, step 1) is intact" in text
    assert not list(root.glob(".tmp_*"))           # the partial save is gone, its space back
    assert latest_checkpoint(root) == before
    assert load_checkpoint(root, actor)["step"] == 1


def test_the_size_estimates_cover_what_a_save_writes(actor, saved, model):
    written = sum(f.stat().st_size for f in latest_checkpoint(saved).iterdir())
    from handoff.preflight import checkpoint_bytes as planned

    cfg = load_config("examples/cpu-tiny.yaml", [f"model.path={model}"])
    for estimate in (checkpoint_bytes(actor), planned(RunPlan.build(cfg))):
        assert written <= estimate <= 1.05 * written, (written, estimate)
