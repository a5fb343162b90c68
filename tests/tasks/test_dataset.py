"""User data files (JSONL / JSON / Parquet), GSM8K, build_task, and their errors."""

import json

import pytest

from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.tasks import ArithmeticTask, DatasetTask, GSM8KTask, build_task, load_records

ROWS = [{"q": f"What is {i} + {i}?", "a": 2 * i, "id": i} for i in range(10)]


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_and_parquet_give_the_same_problems(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    a = DatasetTask(_jsonl(tmp_path / "d.jsonl", ROWS), prompt_field="q", answer_field="a", seed=4)
    b = DatasetTask(tmp_path / "d.parquet", prompt_field="q", answer_field="a", seed=4)
    assert [p.messages for p in a.sample(15)] == [p.messages for p in b.sample(15)]
    assert len(a) == 10


def test_each_epoch_visits_every_record_once_in_a_seeded_order(tmp_path):
    task = DatasetTask(_jsonl(tmp_path / "d.jsonl", ROWS), prompt_field="q", answer_field="a")
    first, second = task.sample(10), task.sample(10)
    assert sorted(p.metadata["row"] for p in first) == list(range(10))
    assert sorted(p.metadata["row"] for p in second) == list(range(10))
    assert [p.metadata["row"] for p in first] != list(range(10))  # shuffled
    for p in first + second:
        assert p.answer == str(2 * p.metadata["row"])
    again = DatasetTask(tmp_path / "d.jsonl", prompt_field="q", answer_field="a")
    again.load_state_dict({"name": "file", "seed": 0, "position": 10})
    assert [p.prompt for p in again.sample(10)] == [p.prompt for p in second]


def test_numeric_and_text_answers_and_message_prompts(tmp_path):
    rows = [{"prompt": "Capital of France?", "answer": "Paris"},
            {"prompt": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "6 x 7?"}], "answer": "42.0"}]
    task = DatasetTask(_jsonl(tmp_path / "d.jsonl", rows))
    by_row = {p.metadata["row"]: p for p in task.sample(2)}
    assert task.reward(by_row[0], "Let me see.\nParis.") == 1.0
    assert task.reward(by_row[0], "Lyon") == 0.0
    assert by_row[1].answer == "42"
    assert [m["role"] for m in by_row[1].messages] == ["system", "user"]
    assert task.reward(by_row[1], "It is 42") == 1.0
    assert task.reward(by_row[1], "\\boxed{41}") == 0.1


def test_gsm8k_reference_and_instruction(tmp_path):
    rows = [{"question": "Natalia sold 48 clips and half as many more. Total?",
             "answer": "She sold 48/2 = 24 more.\n48 + 24 = 72\n#### 72"},
            {"question": "How many?", "answer": "1,000"}]
    task = GSM8KTask(_jsonl(tmp_path / "g.jsonl", rows), prompt_field="question", seed=1)
    probs = {p.metadata["row"]: p for p in task.sample(2)}
    assert probs[0].answer == "72" and probs[1].answer == "1000"
    assert "####" in probs[0].prompt and probs[0].prompt.startswith("Natalia")
    assert task.reward(probs[0], "48 + 24 = 72\n#### 72") == 1.0
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no number here"}])
    with pytest.raises(HandoffError, match="task=file"):
        GSM8KTask(bad, prompt_field="question")


@pytest.mark.parametrize("content, name, words", [
    (None, "missing.jsonl", ["not found", "data.path"]),
    ("", "empty.jsonl", ["no records"]),
    ("\n\n", "blank.jsonl", ["no records"]),
    ('{"prompt": "a", "answer": 1}\n{oops\n', "broken.jsonl", ["broken.jsonl:2", "not valid JSON"]),
    ('[1, 2]', "list.json", ["record 0 of", "not an object"]),
    ('{"prompt": "a", "answer": 1}\n\n[]\n', "rows.jsonl", ["rows.jsonl:3 is a list, not an object"]),
    ("a,b\n", "data.csv", ["unsupported extension", ".parquet"]),
    ("not parquet", "x.parquet", ["not a readable Parquet"]),
    (b'{"prompt": "a", "answer": 1}\n{"prompt": "caf\xe9", "answer": 2}\n', "latin1.jsonl",
     ["latin1.jsonl:2 is not UTF-8", "0xe9", "re-save the file as UTF-8"]),
])
def test_load_errors(tmp_path, content, name, words):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(HandoffError) as e:
        load_records(path)
    for w in words:
        assert w in str(e.value)


def test_a_byte_order_mark_is_not_a_record(tmp_path):
    """A JSONL file saved by a Windows editor starts with U+FEFF: read, not refused as
    "not valid JSON (Unexpected UTF-8 BOM)" (a tester's find)."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n')
    assert [r["prompt"] for r in load_records(path)] == ["a", "b"]
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": 1}\n\xe9\n')   # and a bad byte
    with pytest.raises(HandoffError, match=r"bom.jsonl:2 is not UTF-8 \(byte 0xe9 at offset 32"):
        load_records(path)


@pytest.mark.parametrize("name, words", [
    ("data.csv", ["'data.csv' not found", ".csv is not read: use one of .jsonl"]),
    ("missing.jsonl", ["'missing.jsonl' not found"]),
])
def test_a_missing_relative_data_file_is_not_found_not_a_hub_id(tmp_path, monkeypatch, name,
                                                                words):
    """A bare file name reads as a Hub dataset id too: one with a data file's extension is a
    file that is not there, not a download to run."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HandoffError) as e:
        load_records(name)
    for w in words:
        assert w in str(e.value)
    assert "huggingface-cli download" not in str(e.value)


def test_missing_field_names_the_fields_that_exist(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "solution": "1"}])
    with pytest.raises(HandoffError) as e:
        DatasetTask(path)
    msg = str(e.value)
    assert "data.prompt_field='prompt'" in msg and "question, solution" in msg
    with pytest.raises(HandoffError, match="data.answer_field='answer'"):
        DatasetTask(path, prompt_field="question")
    later = _jsonl(tmp_path / "e.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b"}])
    with pytest.raises(HandoffError, match="record 1 of"):
        DatasetTask(later)
    null = _jsonl(tmp_path / "n.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": None, "answer": 2}])
    with pytest.raises(HandoffError, match="record 1 of .*n.jsonl: its 'prompt' is null"):
        DatasetTask(null)
    odd = _jsonl(tmp_path / "f.jsonl", [{"prompt": 5, "answer": 1}])
    with pytest.raises(HandoffError, match="neither a string nor"):
        DatasetTask(odd)


def test_an_answer_field_holding_a_mapping_or_a_list_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # verl's reward_model instead of reward_model.ground_truth: the answer was the dict's text
    verl = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "v.parquet")
    with pytest.raises(HandoffError, match=r"^record 0 of .*v.parquet: data.answer_field="
                                           r"'reward_model' is a mapping \(keys: style, "
                                           r"ground_truth\), not an answer: .* e.g. "
                                           r"data.answer_field=reward_model.ground_truth$"):
        DatasetTask(tmp_path / "v.parquet", answer_field="reward_model")
    task = DatasetTask(tmp_path / "v.parquet", answer_field="reward_model.ground_truth")
    assert task.get(0).answer in {"1", "2", "3"}
    listed = _jsonl(tmp_path / "l.jsonl", [{"prompt": "a", "answer": 1},
                                           {"prompt": "b", "answer": ["9", "nine"]}])
    with pytest.raises(HandoffError, match=r"^record 1 of .*l.jsonl \(line 2\): data.answer_"
                                           r"field='answer' is a list of 2, not one answer"):
        DatasetTask(listed)


def test_build_task_from_config(tmp_path):
    cfg = load_config(None, ["data.difficulty=2", "data.ops=*"])
    task = build_task(cfg.data, seed=5)
    assert isinstance(task, ArithmeticTask) and task.digits == 2 and task.ops == "*"
    with pytest.raises(HandoffError, match="data.path"):
        build_task(load_config(None, ["data.task=file"]).data)
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = load_config(None, ["data.task=gsm8k", f"data.path={path}", "data.prompt_field=q",
                             "data.answer_field=a"])
    assert isinstance(build_task(cfg.data), GSM8KTask)


def test_a_missing_eval_file_names_data_eval_path():
    from handoff.config import load_config
    from handoff.tasks import build_eval_problems

    cfg = load_config(None, ["data.eval_path=no-such-eval.jsonl"])
    with pytest.raises(HandoffError, match="set data.eval_path to an existing"):
        build_eval_problems(cfg.data, cfg.eval, seed=0)
