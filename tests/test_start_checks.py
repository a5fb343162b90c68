"""What used to fail after step 1 is refused at start (issue 33): tokenizer ids outside the
model's vocabulary, heads and sizes that do not divide, a data record too long for
rollout.max_model_len, run.steps and run.seed past what a run can represent."""

import json
from pathlib import Path

import pytest

from handoff.config import load_config
from handoff.errors import ConfigError, HandoffError
from handoff.model_files import ModelFiles, check_model_dir
from handoff.preflight import count_saves, preflight


def _edit(path, **change):
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(change)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change,match", [
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of "
                                 "num_key_value_heads=3"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None},
     "hidden_size=64 does not divide into num_attention_heads=5 heads and no head_dim"),
    ({"num_key_value_heads": 0}, "field 'num_key_value_heads' is 0, below 1"),
    ({"num_attention_heads": "4"}, "field 'num_attention_heads' is '4', not a whole number"),
    ({"hidden_size": -64}, "field 'hidden_size' is -64, below 1"),
    ({"vocab_size": True}, "field 'vocab_size' is True, not a whole number"),
    ({"num_hidden_layers": 2.5}, "field 'num_hidden_layers' is 2.5, not a whole number"),
])
def test_heads_and_sizes_that_do_not_divide_are_refused_at_start(model, change, match):
    _edit(model / "config.json", **change)
    for check in (check_model_dir, ModelFiles.open):
        with pytest.raises(HandoffError, match=match):
            check(model)


def test_a_head_dim_the_config_gives_need_not_divide_the_hidden_size(model):
    _edit(model / "config.json", num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    check_model_dir(model)   # qwen3 / llama project to heads * head_dim: allowed


@pytest.mark.parametrize("file,change,match", [
    ("config.json", {"vocab_size": 258}, "has token id 259, past the model's vocab_size=258"),
    ("config.json", {"eos_token_id": 400}, "eos_token_id=400 is not a token id of the "
                                           "model's vocab_size=320"),
    ("config.json", {"pad_token_id": -1}, "pad_token_id=-1 is not a token id"),
    ("generation_config.json", {"eos_token_id": [257, 320]}, "eos_token_id=320 is not a token"),
    ("generation_config.json", {"bos_token_id": "256"}, "bos_token_id='256' is not a token"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"500": {"content": "<x>"}}},
     "has token id 500, past the model's vocab_size=320"),
])
def test_tokenizer_and_special_ids_outside_the_vocabulary_are_refused(model, file, change,
                                                                      match):
    _edit(model / file, **change)
    with pytest.raises(HandoffError, match=match):
        check_model_dir(model)


def _data(tmp_path, name, records, blank_first=False):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text(("\n" if blank_first else "")
                        + "\n".join(json.dumps(r) for r in records) + "\n")
    else:
        path.write_text(json.dumps(records))
    return path


def _cfg(model, tmp_path, data, *extra):
    return load_config("examples/cpu-tiny.yaml", [f"model.path={model}",
                                                  f"run.out_dir={tmp_path / 'run'}",
                                                  "data.task=file", f"data.path={data}", *extra])


def test_a_data_record_too_long_is_named_by_its_line_at_start(good, tmp_path):
    records = [{"prompt": "What is 1+1?", "answer": 2}] * 3
    records[2] = {"prompt": "x" * 300, "answer": 1}
    path = _data(tmp_path, "data.jsonl", records, blank_first=True)
    with pytest.raises(HandoffError, match=r"record 2 of .*data.jsonl \(line 4\) has a prompt "
                                           r"of \d+ tokens, more than the 120 "
                                           r"rollout.max_model_len=128 minus "
                                           r"rollout.max_tokens=8 leaves"):
        preflight(_cfg(good, tmp_path, path))
    assert not (tmp_path / "run").exists()
    array = _data(tmp_path, "data.json", records)
    with pytest.raises(HandoffError, match=r"record 2 of .*data.json has a prompt"):
        preflight(_cfg(good, tmp_path, array))
    preflight(_cfg(good, tmp_path, path, "rollout.max_model_len=512"))   # fits: passes


def test_an_evaluation_record_too_long_is_named_at_start_within_eval_n(good, tmp_path):
    train = _data(tmp_path, "data.jsonl", [{"prompt": "What is 1+1?", "answer": 2}])
    records = [{"prompt": "What is 2+2?", "answer": 4}, {"prompt": "x" * 300, "answer": 1}]
    held_out = _data(tmp_path, "eval.jsonl", records)
    evaluates = (f"data.eval_path={held_out}", "run.eval_every=1")
    with pytest.raises(HandoffError, match=r"record 1 of .*eval.jsonl \(line 2\) has a prompt"):
        preflight(_cfg(good, tmp_path, train, *evaluates, "eval.n=0"))
    # only the first eval.n records are evaluated: a longer one past them is never sent
    preflight(_cfg(good, tmp_path, train, *evaluates, "eval.n=1"))
    # nor is any when the run never evaluates
    preflight(_cfg(good, tmp_path, train, f"data.eval_path={held_out}", "run.eval_every=0"))


def test_a_record_too_long_in_a_saved_dataset_directory_is_named_without_a_line(good, tmp_path):
    from datasets import Dataset

    # a save_to_disk directory has no lines: naming one opened the directory (IsADirectoryError)
    Dataset.from_list([{"prompt": "x" * 300, "answer": "1"}]).save_to_disk(tmp_path / "saved")
    with pytest.raises(HandoffError, match=r"record 0 of .*saved has a prompt of \d+ tokens"):
        preflight(_cfg(good, tmp_path, tmp_path / "saved"))


@pytest.mark.parametrize("template,said", [
    ("{% for m in messages %}{{ m.content }{% endfor %}",
     r"TemplateSyntaxError: unexpected '}' at line 1"),
    ("{{ raise_exception('this template refuses') }}", "TemplateError: this template refuses"),
])
@pytest.mark.parametrize("task", ["arithmetic", "file"])
def test_a_broken_chat_template_is_one_line_at_start(model, tmp_path, template, said, task):
    (model / "chat_template.jinja").write_text(template)
    data = _data(tmp_path, "data.jsonl", [{"prompt": "What is 1+1?", "answer": 2}])
    cfg = _cfg(model, tmp_path, data, f"data.task={task}")
    with pytest.raises(HandoffError, match=rf"^{model}/chat_template.jinja cannot be rendered "
                                           rf"\({said}\): fix the template, or set "
                                           r"data.chat_template=false"):
        preflight(cfg)   # the arithmetic task's prompts failed at step 1, after the start
    assert not (tmp_path / "run").exists()
    preflight(_cfg(model, tmp_path, data, f"data.task={task}", "data.chat_template=false"))


def test_a_record_exactly_at_the_limit_passes_and_one_token_more_is_refused(good, tmp_path):
    from handoff.model_files import load_tokenizer
    from handoff.tasks import DatasetTask

    path = _data(tmp_path, "data.jsonl", [{"prompt": "x" * 50, "answer": 1}])
    task = DatasetTask(path)
    tokenizer = load_tokenizer(good)
    n = len(task.encode_prompt(task.get(0), tokenizer, chat=True))
    task.check_prompt_lengths(tokenizer, limit=n, chat=True, setting="the limit")
    with pytest.raises(HandoffError, match=f"prompt of {n} tokens, more than the {n - 1}"):
        task.check_prompt_lengths(tokenizer, limit=n - 1, chat=True, setting="the limit")


@pytest.mark.parametrize("override,match", [
    ("run.steps=1e12", r"run.steps=1000000000000 is out of range \[1, 10000000\]"),
    ("run.steps=10000001", "out of range"),
    ("run.seed=-1", "run.seed=-1 is out of range"),
    (f"run.seed={2**63}", f"run.seed={2**63} is out of range"),
    ("run.seed=1e400", "is not a finite number"),
])
def test_steps_and_seed_past_what_a_run_represents_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("examples/cpu-tiny.yaml", [override])


def test_the_largest_steps_and_seed_load_and_saves_are_counted_not_walked():
    cfg = load_config("examples/cpu-tiny.yaml", ["run.steps=10000000", f"run.seed={2**63 - 1}"])
    assert cfg.run.steps == 10**7 and cfg.run.seed == 2**63 - 1
    for start in range(0, 13):
        for steps in range(1, 13):
            for every in range(0, 5):
                walked = sum(1 for done in range(start + 1, steps + 1)
                             if done == steps or (every and done % every == 0))
                assert count_saves(start, steps, every) == walked, (start, steps, every)
    assert count_saves(0, 10**7, 1) == 10**7


def test_the_hosts_ram_refusing_an_allocation_is_one_line(capsys, monkeypatch):
    """A model larger than the host's RAM (an 8B on a 23 GB CPU machine) ended in torch's
    traceback; it is one line naming the size and the fix. Any other RuntimeError is not
    taken for it (a tester's find)."""
    from handoff import cli

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    @cli.friendly_errors
    def loads_an_8b():
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 98288824320 bytes. "
                           "Error code 12 (Cannot allocate memory)")

    with pytest.raises(SystemExit) as left:
        loads_an_8b()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert left.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: out of host memory (98.3 GB at once)")
    assert "handoff plan --model MODEL --hardware cpu" in lines[0]

    @cli.friendly_errors
    def other():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        other()


@pytest.mark.parametrize("args, said", [
    (["export", "", "--out", "OUT"], "the run directory is empty"),
    (["export", "RUN", "--out", ""], "--out is empty"),
    (["init-model", "--preset", "tiny-qwen3", "--out", ""], "--out is empty"),
    (["generate", "--model", "", "--prompt", "hi"], "--model is empty"),
    (["train", "examples/cpu-tiny.yaml", "model.path="], "model.path is empty"),
])
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(tmp_path, monkeypatch,
                                                                     args, said):
    """Path("") is ".": an export or a model written into wherever the command ran, a model
    read from there (a tester's finds). Run from a directory that must stay as it is."""
    from typer.testing import CliRunner

    from handoff.cli import app

    examples = Path(__file__).resolve().parents[1] / "examples"
    args = [str(examples / a[len("examples/"):]) if a.startswith("examples/") else
            str(tmp_path / a) if a in ("OUT", "RUN") else a for a in args]
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    result = CliRunner().invoke(app, args, terminal_width=300)
    assert result.exit_code == 2 and f"error: {said}: pass " in result.output, result.output
    assert not any(here.iterdir()) and not (tmp_path / "OUT").exists()


def test_overrides_given_as_one_string_are_refused():
    import handoff

    with pytest.raises(HandoffError, match=r"overrides='model.path=x' is a string: pass a list"):
        handoff.train("examples/cpu-tiny.yaml", "model.path=x")
