"""`datasets` directories (save_to_disk) and Hub ids from the local cache as data.path, the
evaluation set (data.eval_path), and their one-line errors; never the network."""

import json
import sys

import pytest

from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.tasks import DatasetTask, build_eval_problems, build_task

datasets = pytest.importorskip("datasets")
ROWS = [{"q": f"What is {i} + {i}?", "a": 2 * i, "level": i % 3, "source": "toy"}
        for i in range(6)]


def _offline_hub(monkeypatch, tmp_path):
    """A Hugging Face cache under tmp_path, and a Hub that fails if anything calls it."""
    import huggingface_hub
    import huggingface_hub.constants

    def no_network(*args, **kwargs):
        raise AssertionError("the Hub was called")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_network)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", no_network)
    return tmp_path / "hub"


def _cache_dataset(hub, repo_id: str, splits: dict) -> None:
    """A dataset as `huggingface-cli download --repo-type dataset` leaves it in the cache."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / f"datasets--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    data = repo / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    for split, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(str(data / f"{split}-00000-of-00001.parquet"))


def test_a_save_to_disk_directory_keeps_every_column_for_the_rewards(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(
        str(tmp_path / "saved"))
    cfg = load_config(None, ["data.task=file", f"data.path={tmp_path / 'saved'}",
                             "data.prompt_field=q", "data.answer_field=a"])
    task = build_task(cfg.data)
    assert len(task) == 6
    problem = task.sample(1)[0]
    row = ROWS[problem.metadata["row"]]
    assert problem.prompt == row["q"] and problem.answer == str(row["a"])
    assert problem.metadata["columns"] == {"a": row["a"], "level": row["level"], "source": "toy"}
    test = DatasetTask(tmp_path / "saved", prompt_field="q", answer_field="a", split="test")
    assert len(test) == 2
    with pytest.raises(HandoffError, match=r"has no split 'validation' \(its splits: train, "
                       r"test\): set data.split"):
        DatasetTask(tmp_path / "saved", prompt_field="q", answer_field="a", split="validation")


def test_a_directory_that_is_no_dataset_is_one_line(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(HandoffError, match=r"is a directory but not a `datasets` dataset"):
        DatasetTask(tmp_path / "plain")


def test_a_hub_id_is_read_from_the_local_cache_only(monkeypatch, tmp_path):
    hub = _offline_hub(monkeypatch, tmp_path)
    _cache_dataset(hub, "someone/toy-math", {"train": ROWS, "test": ROWS[4:]})
    train = DatasetTask("someone/toy-math", prompt_field="q", answer_field="a")
    test = DatasetTask("someone/toy-math", prompt_field="q", answer_field="a", split="test")
    assert len(train) == 6 and len(test) == 2
    assert sorted(p.metadata["columns"]["a"] for p in test.sample(2)) == [8, 10]


def test_a_hub_id_not_in_the_cache_names_the_download_command(monkeypatch, tmp_path):
    _offline_hub(monkeypatch, tmp_path)
    with pytest.raises(HandoffError) as e:
        DatasetTask("someone/absent")
    assert "run `huggingface-cli download --repo-type dataset someone/absent`" in str(e.value)
    assert "\n" not in str(e.value)


def test_without_the_datasets_library_the_error_names_pip_install(monkeypatch, tmp_path):
    (tmp_path / "saved").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(HandoffError, match=r"needs the datasets library: pip install datasets"):
        DatasetTask(tmp_path / "saved")


def test_a_nested_answer_field_reads_verls_ground_truth(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "toy",
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"i": 0}}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "verl.parquet"))
    task = DatasetTask(tmp_path / "verl.parquet", answer_field="reward_model.ground_truth")
    problem = task.get(0)
    assert problem.answer == "2" and problem.metadata["columns"]["data_source"] == "toy"


def test_the_eval_set_is_its_first_n_problems_in_file_order(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    base = ["data.task=gsm8k", f"data.eval_path={path}", "data.prompt_field=q",
            "data.answer_field=a"]
    four = load_config(None, base + ["eval.n=4"])
    task, problems = build_eval_problems(four.data, four.eval)
    assert [p.metadata["row"] for p in problems] == [0, 1, 2, 3]
    assert task.name == "gsm8k" and "####" in problems[0].prompt
    cfg = load_config(None, base)
    _, every = build_eval_problems(cfg.data, cfg.eval)
    assert [p.answer for p in every] == [str(r["a"]) for r in ROWS]
    assert build_eval_problems(load_config().data, load_config().eval) is None


def test_arithmetic_without_an_eval_path_evaluates_on_a_stream_no_run_trains_on():
    cfg = load_config(None, ["data.difficulty=2", "eval.n=20"])
    task, problems = build_eval_problems(cfg.data, cfg.eval, seed=0)
    assert len(problems) == 20 and task.digits == 2 and task.seed < 0
    trained = build_task(cfg.data, seed=0).sample(20)
    assert [p.metadata for p in problems] != [p.metadata for p in trained]
    assert task.score(problems[0], problems[0].answer).correct
    none = load_config(None, ["eval.n=0"])
    assert build_eval_problems(none.data, none.eval) is None
