"""The persistent compile cache (handoff.compile_cache): a second process loads what the first
compiled (inductor's own hit counters, not times); the off switch leaves torch's defaults and
writes nothing under handoff's cache; the warm marks the planner prices with."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from handoff import compile_cache
from handoff.plan.shapes import load_shape

JOB = Path(__file__).with_name("compile_cache_job.py")
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HANDOFF_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("HANDOFF_COMPILE_CACHE", raising=False)
    monkeypatch.setattr(compile_cache, "_active", False)


def _job(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PYTHONPATH=str(SRC), TMPDIR=str(tmp_path / "tmp"),
               TORCHINDUCTOR_COMPILE_THREADS="1")   # no worker pool to start on a small host
    (tmp_path / "tmp").mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, str(JOB)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_first_ones_compile(tmp_path):
    first = _job(tmp_path)
    assert first["fxgraph_miss"] >= 1 and first["fxgraph_hit"] == 0
    assert first["compiles"] == 1            # both layers, both lengths: one graph
    where = tmp_path / "cache" / "compile"
    assert (where / "fxgraph").is_dir() and any((where / "fxgraph").rglob("*"))
    # In torch's default place only what torch keeps there whatever the cache directory: the
    # C++ precompiled headers of a CPU build (torch/_inductor/codecache.py, _HEADER_DIR).
    default = [p.name for d in (tmp_path / "tmp").glob("torchinductor_*") for p in d.iterdir()]
    assert set(default) <= {"precompiled_headers"}
    second = _job(tmp_path)
    assert second["fxgraph_hit"] >= 1 and second["fxgraph_miss"] == 0
    assert second["aot_hit"] >= 1


def test_the_off_switch_leaves_torchs_default_and_handoffs_cache_alone(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir as torch_cache_dir

    monkeypatch.setenv("HANDOFF_COMPILE_CACHE", "0")
    assert compile_cache.activate() is False
    # torch reads its own default, outside handoff's cache, and nothing was made there.
    assert not Path(torch_cache_dir()).is_relative_to(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    compile_cache.mark_warm("some-shape")
    assert not (tmp_path / "cache").exists()


def test_the_switch_on_points_torch_at_handoffs_cache(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir as torch_cache_dir

    assert compile_cache.activate() is True
    assert Path(torch_cache_dir()) == tmp_path / "cache" / "compile"


def test_an_unwritable_cache_leaves_torchs_default_and_no_error(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir as torch_cache_dir

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HANDOFF_CACHE", str(tmp_path / "a-file"))
    assert compile_cache.activate() is False
    assert not Path(torch_cache_dir()).is_relative_to(tmp_path)
    compile_cache.mark_warm("some-shape")   # nothing to mark, nothing raised


def test_a_directory_the_user_chose_for_torch_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.activate() is False
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert not (tmp_path / "cache").exists()


def test_warm_marks_are_per_layer_shape_and_off_with_the_switch(tmp_path, monkeypatch):
    four, small = load_shape("qwen3-4b"), load_shape("qwen3-1.7b")
    key = compile_cache.layer_key(four, "bfloat16")
    assert key != compile_cache.layer_key(small, "bfloat16")
    assert key != compile_cache.layer_key(four, "float32")
    assert not compile_cache.is_warm(key)
    compile_cache.activate()
    compile_cache.mark_warm(key)
    assert compile_cache.is_warm(key)
    assert not compile_cache.is_warm(compile_cache.layer_key(small, "bfloat16"))
    monkeypatch.setenv("HANDOFF_COMPILE_CACHE", "0")
    assert not compile_cache.is_warm(key)
