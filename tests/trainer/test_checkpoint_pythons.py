"""A checkpoint written under any CPython the package supports (3.11.x, 3.12, 3.13) resumes
under any other: DCP's .metadata pickle encodes an enum and a path differently across them
(3.11.0-3.11.3: `getattr(EnumClass, "NAME")`; 3.13: `pathlib._local.PosixPath`), and the
allow-list reads each form, while `getattr` stays a member look-up of DCP's enums only."""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import sysconfig
from glob import glob
from pathlib import Path, PosixPath

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from handoff.config import ActorConfig
from handoff.errors import HandoffError
from handoff.modelzoo import init_model
from handoff.trainer.actor import Actor
from handoff.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from handoff.trainer.checkpoint_files import _MetadataUnpickler

JOB = Path(__file__).parent / "python_checkpoint_job.py"
SRC = Path(__file__).resolve().parents[2] / "src"


def _interpreters() -> dict[str, str]:
    """{version: executable} of every CPython >= 3.11 found on this machine (ours first)."""
    found = {}
    candidates = [sys.executable, *(shutil.which(f"python3.{m}") for m in (11, 12, 13)),
                  *sorted(glob("/usr/bin/python3.1[1-9]")),
                  *sorted(glob("/usr/local/bin/python3.1[1-9]")),
                  *sorted(glob(os.path.expanduser("~/.pyenv/versions/3.1[1-9]*/bin/python3")))]
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "import sys; print(*sys.version_info[:3])"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            continue   # a pyenv shim of a version not selected here, say
        version = tuple(int(x) for x in probe.stdout.split())
        if version >= (3, 11) and ".".join(map(str, version)) not in found:
            found[".".join(map(str, version))] = exe
    return found


def _env(exe: str) -> dict[str, str] | None:
    """The environment under which `exe` imports torch and handoff, or None if it cannot.

    An interpreter of our minor version without torch of its own (Debian's 3.11.2 beside
    our 3.11.7) runs with our site-packages: the same cp311 wheels, its own pickle and enum."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    probe = [exe, "-c", "import torch, transformers"]
    if subprocess.run(probe, env=env, capture_output=True).returncode == 0:
        return env
    minor = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"],
                           capture_output=True, text=True).stdout.strip()
    if minor != str(sys.version_info[:2]):
        return None
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), sysconfig.get_paths()["purelib"]])
    return env if subprocess.run(probe, env=env, capture_output=True).returncode == 0 else None


INTERPRETERS = _interpreters()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("pythons-model"),
                          dtype="float32"))


@pytest.mark.parametrize("version", sorted(INTERPRETERS))
def test_a_checkpoint_written_under_each_python_resumes_under_ours(model, tmp_path, version):
    exe = INTERPRETERS[version]
    env = _env(exe)
    if env is not None:   # the whole checkpoint, written by handoff under that Python
        root = tmp_path / "checkpoints"
        job = subprocess.run([exe, str(JOB), "checkpoint", model, str(root)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert job.returncode == 0, job.stderr[-3000:]
        actor = Actor(model, actor=ActorConfig(), dtype="float32")
        info = load_checkpoint(root, actor)
        assert info["step"] == 3 and info["extra"] == {"task": {"pos": 7}}
        assert {float(v) for t in actor.part_tensors("params") for v in t.unique()} == {0.25}
        return
    # No torch for that Python: the objects DCP's metadata holds besides torch's, pickled by
    # that Python's own pickle and enum modules, read by the allow-list.
    out = tmp_path / "objects.pickle"
    job = subprocess.run([exe, str(JOB), "objects", str(out)], capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    graph = _MetadataUnpickler(open(out, "rb")).load()
    assert graph["formats"] == list(_MEM_FORMAT_ENCODING)
    assert graph["paths"] == [PosixPath("/ckpt/x"), PosixPath("__0_0.distcp")]
    assert type(graph["paths"][0]) is PosixPath and graph["ordered"] == {"a": 1}


def test_the_getattr_form_of_an_enum_member_reads_on_any_python():
    """3.11.0-3.11.3 pickle an enum member as getattr(class, name): read it wherever the
    tests run, with pickle's own reducer for that form."""
    class ByName(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, _MEM_FORMAT_ENCODING):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    import io

    buffer = io.BytesIO()
    ByName(buffer).dump(list(_MEM_FORMAT_ENCODING))
    assert b"getattr" in buffer.getvalue()
    assert _MetadataUnpickler(io.BytesIO(buffer.getvalue())).load() == list(_MEM_FORMAT_ENCODING)


class Call:
    """Unpickles as f(*args): the shape of any getattr payload."""

    def __init__(self, f, *args):
        self.f, self.args = f, args

    def __reduce__(self):
        return self.f, self.args

    def __call__(self):   # pickle wants a callable first; what it calls is the unpickler's
        raise AssertionError("never called here")


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("pythons-saved") / "checkpoints"
    save_checkpoint(root, Actor(model, actor=ActorConfig(), dtype="float32"), step=1,
                    extra={"task": {"pos": 1}})
    return root


def _payloads(marker: Path) -> dict[str, object]:
    return {
        "a path's write_text": Call(Call(getattr, PosixPath(marker), "write_text"), "ran"),
        "os.system": Call(Call(getattr, Call(__import__, "os"), "system"), f"touch {marker}"),
        "posix.system": Call(os.system, f"touch {marker}"),
        "an enum's dunder": Call(Call(getattr, _MEM_FORMAT_ENCODING, "__class__"), "E", (), {}),
        "a non-enum class": Call(getattr, torch.Size, "__new__"),
        "no such member": Call(getattr, _MEM_FORMAT_ENCODING, "TORCH_ANY_FORMAT"),
        "a default": Call(getattr, _MEM_FORMAT_ENCODING, "x", "TORCH_CONTIGUOUS_FORMAT"),
    }


@pytest.mark.parametrize("name", ["a path's write_text", "os.system", "posix.system"])
def test_the_payloads_run_under_plain_pickle(tmp_path, name):
    pickle.loads(pickle.dumps(_payloads(tmp_path / "ran")[name]))
    assert (tmp_path / "ran").exists()


@pytest.mark.parametrize("name", list(_payloads(Path("m"))))
def test_getattr_is_only_an_enum_member_look_up_and_payloads_never_run(model, saved, tmp_path,
                                                                      name):
    marker = tmp_path / "ran"
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    step_dir = latest_checkpoint(root)
    data = pickle.dumps(_payloads(marker)[name])
    (step_dir / ".metadata").write_bytes(data)
    meta = json.loads((step_dir / "meta.json").read_text())   # the hash rewritten to match
    meta["files"][".metadata"] = hashlib.sha256(data).hexdigest()
    (step_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(HandoffError, match="not a DCP metadata file handoff accepts.*nothing in "
                                           "it was run") as e:
        load_checkpoint(root, Actor(model, actor=ActorConfig(), dtype="float32"))
    assert "\n" not in str(e.value)
    assert not marker.exists()
